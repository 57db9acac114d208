"""``--async-save``: checkpoints written in the background over a gloo group of their own
(ptdp.run.checkpoint.saver), while training goes on, hold the state of the iteration they were
taken at; resuming from one equals the uninterrupted run bitwise (float64)."""

from __future__ import annotations

import os

import torch

from helpers.checkpoints import record_run, train_steps
from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint
from ptdp.run.checkpoint.saver import Checkpointer

LAYOUT = (2, 1, 2)  # tp 2 (sharded tensors in the checkpoint) x dp 2 with the distributed optimizer
PARALLEL = {"use_distributed_optimizer": True, "ddp_bucket_size": 777}


def _setup():
    groups = ParallelGroups.build(ParallelLayout(*LAYOUT), PG_TIMEOUT)
    cfg = tiny_config(*LAYOUT, "float64", parallel_overrides=PARALLEL)
    return groups, cfg


def async_worker(rank: int, world: int, root: str) -> dict:
    """4 steps in one go; then a new stage saving asynchronously after step 2, training steps 3
    and 4 while that save is pending, and saving again after step 4 (which completes the first)."""
    groups, cfg = _setup()
    stage = build_stage(cfg, groups)
    whole = record_run(stage, train_steps(stage, cfg, groups, 0, 4))
    stage = build_stage(cfg, groups)
    saver = Checkpointer(groups, async_save=True)
    train_steps(stage, cfg, groups, 0, 2)
    first, earlier = saver.save(stage, root, 2, consumed_samples=2 * cfg.train.global_batch_size)
    pending_latest = os.path.exists(os.path.join(root, "latest"))  # not before the save completes
    train_steps(stage, cfg, groups, 2, 4)  # updates the parameters and Adam state in place meanwhile
    second, completed = saver.save(stage, root, 4, consumed_samples=4 * cfg.train.global_batch_size)
    last = saver.wait()
    return {
        "whole": whole,
        "first": str(first),
        "earlier": earlier,
        "completed": str(completed),
        "second": str(second),
        "last": str(last),
        "pending_latest": pending_latest,
        "latest": open(os.path.join(root, "latest")).read().strip(),
    }


def resume_worker(rank: int, world: int, folder: str, first: int) -> dict:
    groups, cfg = _setup()
    stage = build_stage(cfg, groups)
    start = load_checkpoint(stage, folder)["iteration"]
    assert start == first
    return record_run(stage, train_steps(stage, cfg, groups, start, 4))


def test_async_save_round_trip_and_resume_equal_the_uninterrupted_run(tmp_path):
    root = str(tmp_path)
    world = LAYOUT[0] * LAYOUT[1] * LAYOUT[2]
    saved = run_in_pool(async_worker, world, root)
    for r in saved:
        assert r["earlier"] is None and r["pending_latest"] is False
        assert r["completed"] == r["first"] == os.path.join(root, "iter_0000002")
        assert r["last"] == r["second"] == os.path.join(root, "iter_0000004") and r["latest"] == "iter_0000004"
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "latest"]
    resumed = run_in_pool(resume_worker, world, os.path.join(root, "iter_0000002"), 2)
    at_end = run_in_pool(resume_worker, world, os.path.join(root, "iter_0000004"), 4)
    for r, b, e in zip(saved, resumed, at_end):
        whole = r["whole"]
        assert whole["losses"][2:] == b["losses"] and whole["norms"][2:] == b["norms"]
        for name, value in whole["params"].items():
            torch.testing.assert_close(b["params"][name], value, rtol=0, atol=0)
            torch.testing.assert_close(e["params"][name], value, rtol=0, atol=0)
