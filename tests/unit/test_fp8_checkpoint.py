"""Delayed FP8 scaling's amax histories are checkpointed: a run resumed from a checkpoint takes
the same next step, bitwise, as the run that went on."""

from __future__ import annotations

import dataclasses

import torch

from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.config.fp8 import FP8Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint import io


def _histories(stage) -> dict[str, torch.Tensor]:
    return {n: m.fp8.delayed.history.clone() for n, m in stage.model.named_modules() if getattr(m, "fp8", None)}


def test_delayed_scaling_history_resumes_bitwise(tmp_path):
    fp8 = FP8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=3, fp8_amax_compute_algo="max")
    cfg = tiny_config(1, 1, 1, "float64", fp8=fp8)
    stage = build_stage(cfg, ParallelGroups.single_process())
    for step in range(2):
        train_step(stage, rank_microbatches(step, cfg, 0, 1), step)
    io.save_checkpoint(stage, tmp_path / "ckpt", 2, consumed_samples=16)
    saved = _histories(stage)
    assert saved and all(h[:2].gt(0).all() and not h[2].any() for h in saved.values())
    going_on = train_step(stage, rank_microbatches(2, cfg, 0, 1), 2).loss

    resumed = build_stage(cfg, ParallelGroups.single_process())
    io.load_checkpoint(resumed, tmp_path / "ckpt")
    assert all(torch.equal(h, saved[n]) for n, h in _histories(resumed).items())
    assert train_step(resumed, rank_microbatches(2, cfg, 0, 1), 2).loss == going_on

    longer = dataclasses.replace(cfg, fp8=dataclasses.replace(fp8, fp8_amax_history_len=4))  # not taken
    fresh_history = build_stage(longer, ParallelGroups.single_process())
    io.load_checkpoint(fresh_history, tmp_path / "ckpt")
    assert all(not h.any() for h in _histories(fresh_history).values())
    assert train_step(fresh_history, rank_microbatches(2, longer, 0, 1), 2).loss != going_on
