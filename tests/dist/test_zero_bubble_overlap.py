"""Zero-bubble schedules start the data-parallel reduction of a chunk's buckets during the W that
completes its gradients (each bucket once all its weight-gradient closures ran), not after the
schedule; with overlap off nothing starts before the step's end."""

from __future__ import annotations

import pytest

from helpers.dist_helpers import run_in_pool
from helpers.layout_cases import PG_TIMEOUT, rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.pipeline.runtime import run_schedule
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.program import build_programs


def events(rank: int, world: int, kind: str, overlap: bool) -> dict:
    """One step's schedule at pp = 2, dp = 2 (float64, small buckets): the order of weight-gradient
    closures ("w") and bucket launches ("launch"), before the reductions are finished."""
    parallel = {"pipeline_schedule": kind, "overlap_grad_reduce": overlap, "ddp_bucket_size": 700}
    cfg = tiny_config(
        1, 2, 2, "float64", train_overrides={"micro_batch_size": 1}, parallel_overrides=parallel, num_layers=4
    )
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=2), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    log: list[str] = []
    buffer, launch = stage.grads, stage.grads._launch
    buffer._launch = lambda bucket: (log.append("launch"), launch(bucket))[1]  # type: ignore[method-assign]
    for chunk in stage.chunks:
        queue, put = chunk.wgrad_queue, chunk.wgrad_queue.put
        queue.put = lambda job, param, put=put: put(lambda: (job(), log.append("w")), param)  # type: ignore[method-assign]
    microbatches = rank_microbatches(0, cfg, groups.dp.rank, 2)
    program = build_programs(kind, 2, len(microbatches), stage.virtual_stages)[groups.pp.rank]
    buffer.zero()
    run_schedule(
        program,
        stage.model,
        microbatches,
        pp=groups.pp,
        hidden_shape=stage.hidden_shape,
        dtype=stage.dtype,
        device=stage.device,
        grad_sync=buffer,
        batch_shape=(1, cfg.model.seq_length),
        placement=placement_of(kind),
    )
    launched = log.count("launch")
    buffer.finish()
    # the tied embedding's bucket starts after its sum over the embedding group (finalize_grads)
    return {"log": log, "launched_in_schedule": launched, "buckets": sum(b.overlap for b in buffer.buckets)}


@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
def test_reductions_start_during_the_last_w(kind):
    for res in run_in_pool(events, 4, kind, True):
        log = res["log"]
        assert res["buckets"] > 1 and res["launched_in_schedule"] == res["buckets"]
        first_launch, last_w = log.index("launch"), len(log) - 1 - log[::-1].index("w")
        assert first_launch < last_w, log  # a bucket reduces while weight gradients are still computed


def test_no_reduction_in_the_schedule_without_overlap():
    for res in run_in_pool(events, 4, "zb-h1", False):
        assert res["launched_in_schedule"] == 0 and res["log"].count("w") > 0
