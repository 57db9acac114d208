"""The MoE benchmark's arithmetic: active weights, the forced routing's loads and the ep traffic
formula it checks ptdp's counts against, and the experts timed grouped and as a loop."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers.bench_scripts import import_scripts


@pytest.fixture
def bench(monkeypatch):
    names = ("bench_moe", "moe_common", "gpu_report")
    return dict(zip(names, import_scripts(monkeypatch, *names)))


def test_the_moe_gpt_has_the_dense_gpts_active_weights(bench):
    common = bench["moe_common"]
    moe = common.moe_options(512, num_experts=8, topk=2)
    assert (moe.expert_ffn(512), moe.moe_grouped_gemm, moe.moe_router_force_load_balancing) == (256, True, False)
    w = common.active_weights(128, 512, moe)
    assert w["dense_mlp"] == w["moe_active"] == 2 * 128 * 512 and w["moe_experts"] == 4 * w["dense_mlp"]
    assert w["router"] == 8 * 128 and "E / k = 4 x" in w["text"]
    with pytest.raises(ValueError, match="not divisible by top-k 3"):
        common.moe_options(512, num_experts=8, topk=3)


def test_forced_loads_and_the_ep_traffic_formula(bench):
    """Dropless: each rank sends T k rows; over an ep group the rows received add up to those sent,
    with uneven loads too (T k = 10 assignments over 8 experts)."""
    b = bench["bench_moe"]
    assert b.expert_loads(4, 2, 8) == [1] * 8 and b.expert_loads(5, 2, 8) == [2, 2, 1, 1, 1, 1, 1, 1]
    args = argparse.Namespace(micro_batch_size=1, seq_length=5, global_batch_size=8, num_layers=3, hidden_size=16)
    for ep in (2, 4):
        per_rank = [b.expected_traffic(args, ep, r) for r in range(ep)]
        calls = 2 * 3  # m = B / (b dp) = 2 microbatches, 3 MoE layers
        for t in per_rank:
            assert t["ep/all_to_all/moe_dispatch"] == t["ep/all_to_all/moe_combine_grad"]
            assert t["ep/all_to_all/moe_dispatch"] == {"calls": calls, "numel": calls * 10 * 16, "bytes": calls * 640}
            assert t["ep/all_to_all/moe_counts"] == {"calls": calls, "numel": calls * 8, "bytes": calls * 64}
        received = [t["ep/all_to_all/moe_combine"]["numel"] for t in per_rank]
        assert sum(received) == ep * calls * 10 * 16 and len(set(received)) == 2  # uneven, summing to A
    assert b.expected_traffic(args, 2, 0)["ep/all_to_all/moe_combine"]["numel"] == calls * 2 * 6 * 16


def test_experts_grouped_and_loop_agree_and_are_timed(bench):
    row = bench["moe_common"].time_expert_gemms(
        num_experts=4,
        hidden=16,
        ffn=32,
        tokens=8,
        topk=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        reps=2,
        budget=bench["gpu_report"].Budget(60),
    )
    assert row["rows"] == 16 and row["timed"] == 2 and row["grouped_s"] > 0 and row["loop_s"] > 0
    assert row["grouped_gemm_used"] == hasattr(torch, "_grouped_mm")
    assert row["max_rel_diff_grouped_vs_loop"] < 1e-6
    assert row["grouped_over_loop"] == row["grouped_s"] / row["loop_s"]
