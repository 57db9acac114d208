"""The word embedding's gradient straight into ``main_grad`` on two gloo ranks: the vocab-parallel lookup
at tp = 2 (ids on the other shard masked), a bfloat16 GPT at tp = 2 (tied, untied, sequence
parallel) against autograd's 16-bit path, and at dp = 2 the bucket holding the tied embedding still
starts its reduction during backward."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.embedding_cases import LOOKUP_PADDED, embedding_gradients, lookup_reference, lookup_run
from helpers.layout_cases import tiny_config
from helpers.torch_features import NEEDS_FUSED_WGRAD
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

# Every test here checks the fused path, which is off on a torch that runs no post-accumulate hook
# without a gradient (docs/testing.md#older-torch).
pytestmark = NEEDS_FUSED_WGRAD

GPT_CASES = {  # name: (tiny_config keyword arguments, token ids modulo)
    "tied": ({}, None),
    "untied": ({"untie_embeddings_and_output_weights": True}, None),
    "tied_repeats": ({}, 5),
    "untied_repeats": ({"untie_embeddings_and_output_weights": True}, 5),
    "tied_sp": ({"parallel_overrides": {"sequence_parallel": True}}, 5),
}


def worker(rank: int, world: int, tp: int, dp: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=tp, dp=dp), PG_TIMEOUT)
    out = {}
    if tp == 2:
        for name, dtype, main_grad in (
            ("bf16", torch.bfloat16, True),
            ("bf16_autograd", torch.bfloat16, False),
            ("f64", torch.float64, True),
            ("f64_autograd", torch.float64, False),
        ):
            out[name] = lookup_run(groups.tp, dtype, main_grad=main_grad)
        cases = GPT_CASES
    else:
        cases = {"tied": GPT_CASES["tied"], "tied_repeats": GPT_CASES["tied_repeats"]}
    for name, (kwargs, distinct) in cases.items():
        cfg = tiny_config(tp, 1, dp, "bfloat16", **kwargs)
        out[name] = {fused: embedding_gradients(cfg, groups, fused=fused, distinct=distinct) for fused in (True, False)}
    return out


@functools.cache
def results(tp: int, dp: int) -> list[dict]:
    return run_in_pool(worker, tp * dp, tp, dp)


def test_vocab_parallel_lookup_adds_its_rows_into_main_grad():
    """tp = 2: each rank's main_grad is its rows of the single-process sum (float64 to 1e-12; the
    bfloat16 lookup's float32 sums to float32 rounding), no 16-bit table-shaped tensor is made,
    .grad stays None and the post-accumulate hook runs once per backward; float64 without main_grad
    is autograd's gradient."""
    res = results(2, 1)
    for key, ref in (
        ("f64", lookup_reference()),
        ("f64_autograd", lookup_reference()),
        ("bf16", lookup_reference(torch.bfloat16)),
    ):
        grads = torch.cat([r[key]["grad"] for r in res])
        tol = dict(rtol=1e-6, atol=1e-6) if key == "bf16" else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads, 2 * ref, **tol, msg=lambda m: f"{key}: {m}")
        assert grads.shape[0] == LOOKUP_PADDED
    for r in res:
        assert r["bf16"]["rows"][1] - r["bf16"]["rows"][0] == LOOKUP_PADDED // 2
        assert torch.equal(r["bf16"]["out"], r["bf16_autograd"]["out"])
        assert r["bf16"]["made"] == [] and r["bf16"]["grad_is_none"] and r["f64"]["grad_is_none"]
        assert r["bf16"]["arrived"] == [False, False] and r["bf16"]["hooks"] == 2
        assert r["bf16_autograd"]["made"] and r["bf16_autograd"]["arrived"] == [True, True]


@pytest.mark.parametrize("case", sorted(GPT_CASES))
def test_bf16_gpt_at_tp2_embedding_gradient_matches_autograds_path(case):
    """Per rank, the word embedding's buffer equals autograd's 16-bit path's (exactly without repeated
    tokens, else to bfloat16 rounding of that path's sums); untied and without sequence parallelism
    it is the float64 sum of the rows the lookup received to float32 rounding; no gradient reaches
    autograd's accumulation, whose hook runs once per backward. (With ids modulo 5 and untied, rank 1's
    rows are never looked up: its gradient is zero on both paths.)"""
    repeats, res = GPT_CASES[case][1] is not None, results(2, 1)
    assert sum(r[case][True]["word"].abs().sum() for r in res) > 0
    for r in res:
        fused, plain = r[case][True], r[case][False]
        tol = dict(rtol=2e-2, atol=1e-3) if repeats else dict(rtol=0, atol=0)
        torch.testing.assert_close(fused["word"], plain["word"], **tol)
        if case.startswith("untied"):
            torch.testing.assert_close(fused["output"], plain["output"], rtol=0, atol=0)
            torch.testing.assert_close(fused["word"].double(), fused["lookup"], rtol=1e-6, atol=1e-7)
        assert fused["arrived"] == [False, False] and fused["hooks"] == 2 and fused["grad_is_none"]
        assert plain["arrived"] == [True, True]


@pytest.mark.parametrize("case", ["tied", "tied_repeats"])
def test_tied_embedding_bucket_still_starts_in_backward_at_dp2(case):
    """dp = 2, pp = 1, tied: the lookup's and the output layer's gradients both go into main_grad,
    the buffer's hook still marks the weight complete, so its bucket's all-reduce starts during the
    synchronising backward; the reduced gradient matches autograd's path to bfloat16 rounding of that
    path's sums (dp rank 1's first microbatch repeats a token) and is equal on both dp ranks."""
    res = results(1, 2)
    for r in res:
        fused, plain = r[case][True], r[case][False]
        assert fused["started"] and plain["started"]
        torch.testing.assert_close(fused["word"], plain["word"], rtol=2e-2, atol=1e-3)
        assert fused["arrived"] == [False, False] and fused["hooks"] == 2
    assert torch.equal(res[0][case][True]["word"], res[1][case][True]["word"])
