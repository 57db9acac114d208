"""The pipeline runtime posts exactly the point-to-point groups that ``ptdp schedule --json`` lists
(same order, peers and message tags, one ``batch_isend_irecv`` per group), at every schedule, with
more microbatches than stages."""

from __future__ import annotations

import json

import pytest

from helpers.dist_helpers import run_in_pool
from helpers.layout_cases import PG_TIMEOUT, rank_microbatches, tiny_config
from ptdp.cli import main as ptdp_main
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout

CASES = [
    ("1f1b", 4, 1),
    ("gpipe", 4, 1),
    ("interleaved-1f1b", 4, 2),
    ("interleaved-1f1b", 2, 2),
    ("zb-h1", 4, 1),
    ("zb-h2", 4, 1),
    ("zb-v", 4, 2),
    ("dualpipev", 4, 2),
    ("zb-v", 2, 2),
]


def posted_groups(rank: int, world: int, kind: str, v: int) -> list:
    """One training step at tp = dp = 1, pp = world, 8 microbatches; the batches this rank posted."""
    parallel = {"pipeline_schedule": kind}
    if v > 1:
        parallel["num_layers_per_virtual_pipeline_stage"] = 8 // (world * v)
    cfg = tiny_config(
        1, world, 1, "float64", train_overrides={"micro_batch_size": 1}, parallel_overrides=parallel, num_layers=8
    )
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=world, dp=1), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    groups.stats.p2p_log = []
    train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)
    return [[list(op) for op in ops] for axis, ops in groups.stats.p2p_log if axis == "pp"]


def schedule_json(capsys, kind: str, p: int, m: int, v: int) -> dict:
    assert (
        ptdp_main(
            [
                "schedule",
                "--pipeline-schedule",
                kind,
                "--pp",
                str(p),
                "--num-microbatches",
                str(m),
                "--virtual-pipeline-stages",
                str(v),
                "--json",
            ]
        )
        == 0
    )
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


def released_outputs(rank: int, world: int, free: bool) -> dict:
    """One 1F1B step at pp = 2 (4 microbatches, float64); the storage bytes of each activation this
    rank sent, right after its group completed, and the gradients. ``free=False``: keep them."""
    import ptdp.engine.pipeline.runtime as runtime

    cfg = tiny_config(1, world, 1, "float64", train_overrides={"micro_batch_size": 2})
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=world, dp=1), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    sizes, original, freeable = [], runtime._release, runtime._FREEABLE

    def release(state, key):
        original(state, key)
        sizes.append(state.outputs[key].untyped_storage().nbytes())

    runtime._release, runtime._FREEABLE = release, (freeable if free else ())
    try:
        result = train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)
    finally:
        runtime._release, runtime._FREEABLE = original, freeable
    grads = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    return {"sizes": sizes, "loss": result.loss, "grads": stage.grads.data.clone(), "params": grads}


def test_sent_activations_are_released_and_gradients_unchanged():
    import torch

    freed = run_in_pool(released_outputs, 2, True)
    kept = run_in_pool(released_outputs, 2, False)
    assert len(freed[0]["sizes"]) == 4 and set(freed[0]["sizes"]) == {0}  # rank 0 sent 4 activations
    assert min(kept[0]["sizes"]) > 0
    for a, b in zip(freed, kept):
        assert a["loss"] == b["loss"]
        torch.testing.assert_close(a["grads"], b["grads"], rtol=0, atol=0)
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=0)
