"""The pipeline runtime posts exactly the point-to-point groups that ``ptdp schedule --json`` lists
(same order, peers and message tags, one ``batch_isend_irecv`` per group), at every schedule, with
more microbatches than stages."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main as ptdp_main
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.step import build_stage, train_step
from ptdp.spec.layout import ParallelLayout

from helpers.dist_helpers import run_in_pool
from helpers.layout_cases import PG_TIMEOUT, rank_microbatches, tiny_config

CASES = [("1f1b", 4, 1), ("gpipe", 4, 1), ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 2, 2)]


def posted_groups(rank: int, world: int, kind: str, v: int) -> list:
    """One training step at tp = dp = 1, pp = world, 8 microbatches; the batches this rank posted."""
    parallel = {"pipeline_schedule": kind}
    if v > 1:
        parallel["num_layers_per_virtual_pipeline_stage"] = 8 // (world * v)
    cfg = tiny_config(1, world, 1, "float64", train_overrides={"micro_batch_size": 1},
                      parallel_overrides=parallel, num_layers=8)
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=world, dp=1), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    groups.stats.p2p_log = []
    train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)
    return [[list(op) for op in ops] for axis, ops in groups.stats.p2p_log if axis == "pp"]


def schedule_json(capsys, kind: str, p: int, m: int, v: int) -> dict:
    assert ptdp_main(["schedule", "--pipeline-schedule", kind, "--pp", str(p), "--num-microbatches", str(m),
                      "--virtual-pipeline-stages", str(v), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind,p,v", CASES)
def test_runtime_posts_the_groups_of_ptdp_schedule(capsys, kind, p, v):
    listed = schedule_json(capsys, kind, p, 8, v)
    posted = run_in_pool(posted_groups, p, kind, v)
    for rank, groups in enumerate(posted):
        want = [[[o["op"], o["peer"], o["tag"]] for o in g["ops"]] for g in listed["ranks"][rank]["p2p_groups"]]
        assert groups == want, f"rank {rank}"
        assert all(g["communicator"] == "pp" for g in listed["ranks"][rank]["p2p_groups"])
    assert sum(len(g) for g in posted[0]) > 0
