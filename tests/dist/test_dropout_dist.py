"""Dropout under tensor, pipeline and data parallelism, in one world of 4 gloo workers: (2, 1, 2)
mask properties (also with sequence parallelism), reproducibility, recompute and checkpoint
resume; (2, 2, 1), also interleaved, equal to the single-process run (masks and training). The
one-process parts and the overview: tests/unit/test_dropout.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.dropout_cases import RECOMPUTE, assert_bitwise, config, train
from helpers.layout_cases import STEPS, TOL, full_parameters
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint


def by_stream(masks: list[tuple[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name, mask in masks:
        out.setdefault(name, []).append(mask)
    return out


@functools.cache
def single_process_runs() -> dict:
    groups = ParallelGroups.single_process()
    return {
        "plain": train(config(1, 1, 1), groups, record=True),
        "interleaved": train(config(1, 1, 1, num_layers=8), groups, record=True),
    }


def _worker(rank: int, world: int, folder: str) -> dict:
    out = {}
    # (2, 2, 1): the same masks and training as one process (also 2 chunks per rank)
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=1), PG_TIMEOUT)
    for name, cfg in (
        ("plain", config(2, 2, 1)),
        ("interleaved", config(2, 2, 1, num_layers=8, parallel={"num_layers_per_virtual_pipeline_stage": 2})),
    ):
        out[("221", name)] = _portable(train(cfg, groups, record=True))
    # (2, 1, 2): mask properties, reproducibility, recompute, checkpoint resume
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=1, dp=2), PG_TIMEOUT)
    cfg = config(2, 1, 2)
    out[("212", "plain")] = _portable(train(cfg, groups, record=True))
    out[("212", "again")] = _portable(train(cfg, groups))
    for name in ("full_uniform_1", "selective"):
        out[("212", name)] = _portable(train(config(2, 1, 2, **RECOMPUTE[name]), groups))
    sp = {"sequence_parallel": True}
    out[("212", "sp")] = _portable(train(config(2, 1, 2, parallel=sp), groups, record=True))
    out[("212", "sp_recompute")] = _portable(train(config(2, 1, 2, parallel=sp, **RECOMPUTE["full_uniform_1"]), groups))
    out[("212", "resume")] = _resume(cfg, groups, Path(folder))
    return out


def _resume(cfg: Config, groups: ParallelGroups, folder: Path) -> dict:
    """Train 2 steps, save, train the 3rd; a new stage loading the checkpoint trains the 3rd
    again, with the saved dropout streams and without them (reseeded)."""
    first = train(cfg, groups, steps=range(2))
    save_checkpoint(first["stage"], folder, 2, consumed_samples=2 * cfg.train.global_batch_size)
    uninterrupted = train(cfg, groups, steps=[2], stage=first["stage"])
    resumed, reseeded = build_stage(cfg, groups), build_stage(cfg, groups)
    load_checkpoint(resumed, folder)
    load_checkpoint(reseeded, folder, load_rng=False)
    assert reseeded.dropout_rng.reseed_iteration == 2
    return {
        name: _portable(run)
        for name, run in (
            ("uninterrupted", uninterrupted),
            ("resumed", train(cfg, groups, steps=[2], stage=resumed)),
            ("reseeded", train(cfg, groups, steps=[2], stage=reseeded)),
        )
    }


def _portable(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "stage"}


@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> list[dict]:
    return run_in_pool(_worker, 4, str(tmp_path_factory.mktemp("dropout_ckpt")))


def test_tp2_dp2_mask_properties(parallel):
    runs = {r[("212", "plain")]["coords"][:2]: r[("212", "plain")]["masks"] for r in parallel}
    heads_seen = set()
    for dp in (0, 1):  # tp ranks of a replica: hidden masks equal, head masks differ
        a, b = runs[(0, dp)], runs[(1, dp)]
        hidden_a = [(n, m) for n, m in a if "/head" not in n]
        hidden_b = [(n, m) for n, m in b if "/head" not in n]
        m = 2  # microbatches per step and replica
        assert len(hidden_a) == STEPS * m * (1 + 2 * 4)  # embedding + 2 per layer, 4 layers
        assert [n for n, _ in hidden_a] == [n for n, _ in hidden_b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(hidden_a, hidden_b))
        heads_a = [(n, m) for n, m in a if "/head" in n]
        heads_b = [(n, m) for n, m in b if "/head" in n]
        assert len(heads_a) == len(heads_b) == STEPS * m * 4 * 2  # 4 layers x 2 local heads
        assert not {n for n, _ in heads_a} & {n for n, _ in heads_b}
        assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(heads_a, heads_b))
        heads_seen |= {n.split("/")[1] for n, _ in heads_a + heads_b}
    assert heads_seen == {"head0", "head1", "head2", "head3"}
    for tp in (0, 1):  # dp replicas: every mask differs
        a, b = runs[(tp, 0)], runs[(tp, 1)]
        assert [n for n, _ in a] == [n for n, _ in b]
        assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_tp2_dp2_sequence_parallel_masks_differ_over_tp(parallel):
    """Hidden states [s/2, b, h] per rank: every rank masks its part from its own stream."""
    runs = {
        r[("212", "sp")]["coords"][:2]: [(n, m) for n, m in r[("212", "sp")]["masks"] if "/head" not in n]
        for r in parallel
    }
    for (tp, _dp), masks in runs.items():
        assert masks and all(n.endswith(f"/tp{tp}") and m.shape == (4, 2, 32) for n, m in masks)
    for i in range(len(runs[(0, 0)])):
        assert len({tuple(masks[i][1].flatten().tolist()) for masks in runs.values()}) == 4, i
    for r in parallel:
        assert_bitwise(r[("212", "sp_recompute")], r[("212", "sp")], "sequence parallel, full recompute")


def test_tp2_dp2_reproducible_and_recompute_replays_masks(parallel):
    for r in parallel:
        assert_bitwise(r[("212", "again")], r[("212", "plain")], "second run")
        for name in ("full_uniform_1", "selective"):
            assert_bitwise(r[("212", name)], r[("212", "plain")], name)
    assert len({tuple(r[("212", "plain")]["losses"]) for r in parallel}) == 1


def test_tp2_dp2_checkpoint_resume_is_bitwise(parallel):
    for r in parallel:
        runs = r[("212", "resume")]
        assert_bitwise(runs["resumed"], runs["uninterrupted"], "resumed")
        assert runs["reseeded"]["losses"] != runs["uninterrupted"]["losses"]


@pytest.mark.parametrize("variant", ["plain", "interleaved"])
def test_tp2_pp2_masks_and_training_equal_single_process(parallel, variant):
    ref = single_process_runs()[variant]
    want = by_stream(ref["masks"])
    results = [r[("221", variant)] for r in parallel]
    seen = set()
    for res in results:
        for name, masks in by_stream(res["masks"]).items():
            assert len(masks) == len(want[name]) and all(torch.equal(x, y) for x, y in zip(masks, want[name])), name
            seen.add(name)
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    assert seen == set(want)
    got = full_parameters([{variant: r} for r in results], variant)
    for name, (tensor, spec, _) in ref["params"].items():
        real = tensor[: spec.real_rows] if spec.real_rows is not None else tensor
        torch.testing.assert_close(got[name], real, **TOL["float64"], msg=lambda m: f"{name}: {m}")
