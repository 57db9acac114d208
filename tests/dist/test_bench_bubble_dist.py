"""The bubble benchmark's harness (``benchmarks/bench_schedule_bubble.py``) on ptdp's runtime over
gloo: every rank runs its program's computes, each B queues one W closure that W runs, and the
sleeping chunks' weight gradients equal one float64 process's, for whole and split backwards. No
time is asserted: the benchmark's times are in BENCHMARKS.md."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers.bench_scripts import BENCHMARKS, import_scripts
from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout
from ptdp.layout.pipeline.placement import placement_of, virtual_stage
from ptdp.layout.pipeline.timing import StageTimes

P, M = 2, 4
TIMES = StageTimes(0.001, 0.001, 0.001)
SPLIT = ("zb-h1", "zb-h2", "zb-v")


def bench_module():
    """The benchmark, imported in a worker (``benchmarks/`` put on its path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import bench_schedule_bubble

    return bench_schedule_bubble


def one_step(rank: int, world: int, kind: str) -> dict:
    """One float64 step of the benchmark's chunks under ``kind``: each chunk's calls and gradient."""
    bench = bench_module()
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=world, dp=1), PG_TIMEOUT)
    v = bench.virtual_stages_of(kind, 2)
    chunks = bench.sleep_chunks(kind, rank, world, v, TIMES, torch.float64)
    program = bench.programs(kind, world, M, v, TIMES)[rank]
    bench.run_step(program, chunks, bench.microbatches(M, torch.float64), groups.pp, placement_of(kind))
    return {
        "calls": [c.calls for c in chunks],
        "grads": [c.weight.grad for c in chunks],
        "slept": sum(c.slept for c in chunks),
    }


def reference_grads(bench, stages: int) -> list[torch.Tensor]:
    """Every virtual stage's weight gradient in one process: the stages chained, mean loss over M."""
    zero = StageTimes(0.0, 0.0, 0.0).durations()
    chunks = [
        bench.SleepChunk(zero, bench.stage_weight(k, torch.float64), first=k == 0, last=k == stages - 1)
        for k in range(stages)
    ]
    for tokens, labels in bench.microbatches(M, torch.float64):
        x = tokens
        for chunk in chunks:
            x = chunk(x, labels if chunk.last else None)
        (x / M).backward()
    assert all(c.calls["wgrad_inline"] == M for c in chunks)
    return [c.weight.grad for c in chunks]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"])
def test_harness_runs_every_compute_and_matches_one_process(monkeypatch, kind):
    (bench,) = import_scripts(monkeypatch, "bench_schedule_bubble")
    v = bench.virtual_stages_of(kind, 2)
    ranks = run_in_pool(one_step, P, kind)
    reference = reference_grads(bench, P * v)
    split = kind in SPLIT
    for r, got in enumerate(ranks):
        for c in range(v):
            calls = got["calls"][c]
            if kind == "dualpipev":  # whole backwards in its middle, B and W apart at the ends
                assert calls["wgrad_queued"] == calls["wgrad_run"] > 0, (r, c, calls)
                assert calls["wgrad_inline"] + calls["wgrad_run"] == M and calls["forward"] == calls["backward"] == M
            else:
                assert calls == {
                    "forward": M,
                    "backward": M,
                    "wgrad_inline": 0 if split else M,
                    "wgrad_queued": M if split else 0,
                    "wgrad_run": M if split else 0,
                }, (r, c)
            stage = virtual_stage(r, c, P, placement_of(kind))
            torch.testing.assert_close(got["grads"][c], reference[stage], rtol=1e-9, atol=0)
        # every compute slept: M forwards, M Bs and M Ws of 1 ms per chunk, over v chunks
        assert got["slept"] >= 3 * M * 1e-3 * (1 - 1e-9)
