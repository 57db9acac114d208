"""ptdp's ZB-V and DualPipeV against torch.distributed.pipelining's ScheduleZBVZeroBubble and
ScheduleDualPipeV on the same GPT, weights and microbatches (float64, pp = 2, 8 microbatches):
every gradient of one step equal between the two and to one process running the whole model."""

from __future__ import annotations

import pytest
import torch

from helpers.bench_scripts import load_script
from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import TOL, rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout

CASES = [("zb-v", "ScheduleZBVZeroBubble", False), ("dualpipev", "ScheduleDualPipeV", True)]


def config(pp: int, kind: str, untied: bool):
    parallel = {"pipeline_schedule": kind} if pp > 1 else {}
    return tiny_config(
        1,
        pp,
        1,
        "float64",
        train_overrides={"micro_batch_size": 1},
        parallel_overrides=parallel,
        untie_embeddings_and_output_weights=untied,
    )


def one_step(rank: int, world: int, kind: str, torch_name: str, untied: bool) -> dict:
    """One step of each library from the same weights: this rank's losses and gradients by name."""
    bench = load_script("bench_vs_torch_zero_bubble")
    cfg = config(world, kind, untied)
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=world, dp=1), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    side = bench.torch_side(stage, torch_name)
    microbatches = rank_microbatches(0, cfg, 0, 1)
    tokens, labels = (torch.cat(x) for x in zip(*microbatches))
    ptdp_losses = bench.ptdp_step(stage, microbatches)
    torch_losses = side.step(tokens, labels)
    return {
        "ptdp": (ptdp_losses, bench.named_grads(stage.model)),
        "torch": (torch_losses, bench.named_grads(side.chunks)),
    }


@pytest.mark.parametrize(("kind", "torch_name", "untied"), CASES, ids=[c[0] for c in CASES])
def test_gradients_equal_torch_pipelining_and_one_process(kind, torch_name, untied):
    bench = load_script("bench_vs_torch_zero_bubble")
    results = run_in_pool(one_step, 2, kind, torch_name, untied)
    microbatches = rank_microbatches(0, config(1, kind, untied), 0, 1)
    ref_losses, ref_grads = bench.reference(config(1, kind, untied), microbatches)
    grads = {lib: {k: v for r in results for k, v in r[lib][1].items()} for lib in ("ptdp", "torch")}
    assert set(grads["ptdp"]) == set(grads["torch"]) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(
            grads["torch"][name], grads["ptdp"][name], **TOL["float64"], msg=lambda m, name=name: f"{name}: {m}"
        )
        torch.testing.assert_close(grads["ptdp"][name], ref, **TOL["float64"], msg=lambda m, name=name: f"{name}: {m}")
    # losses on the last stage's rank (0): torch's loss_fn gives them times 1/m
    m = len(microbatches)
    ptdp_losses, torch_losses = results[0]["ptdp"][0], results[0]["torch"][0]
    torch.testing.assert_close(
        torch.stack(ptdp_losses), torch.tensor(ref_losses, dtype=torch.float64), **TOL["float64"]
    )
    torch.testing.assert_close(torch.stack(torch_losses) * m, torch.stack(ptdp_losses), **TOL["float64"])
    assert results[1]["ptdp"][0] == [] and results[1]["torch"][0] == []
