"""Activation recomputation at (tp, pp, dp) = (2, 2, 2): bitwise the same training as without it,
and the forward all-reduces a recomputed group repeats (the overview and the one-process
parts: tests/unit/test_recompute.py)."""

from __future__ import annotations

import pytest

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.recompute_cases import CASES, assert_bitwise, run_cases
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout


def recompute_worker(rank: int, world: int, tp: int, pp: int, dp: int) -> dict:
    return run_cases(tp, pp, dp, ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT))


@pytest.fixture(scope="module")
def results_222() -> list[dict]:
    return run_in_pool(recompute_worker, 8, 2, 2, 2)


def test_tp2_pp2_dp2_recompute_is_bitwise_identical(results_222):
    for rank_results in results_222:
        for base, recompute in CASES:
            assert_bitwise(rank_results, base, recompute)


def test_recompute_repeats_forward_all_reduces(results_222):
    """Per microbatch, a recomputed group of n layers repeats its n attention-output all-reduces
    and the first n - 1 MLP-output ones (the recompute stops after the group's last fc2 matmul);
    backward all-reduces and everything else stay as without recompute. Selective: nothing."""
    m, layers = 2, 2  # microbatches per step; layers per stage at pp = 2
    extra = {  # (attn_proj, mlp_fc2) extra all-reduces per microbatch on one stage
        "full_uniform_1": (2, 0),
        "full_uniform_2": (2, 1),
        "full_block_1": (1, 0),
        "selective": (0, 0),
    }
    for rank_results in results_222:
        base = rank_results[("float64", None)]["comm"]
        assert base["tp/all_reduce/attn_proj"]["calls"] == layers * m
        for recompute, (attn, mlp) in extra.items():
            comm = rank_results[("float64", recompute)]["comm"]
            want = dict(base)
            for tag, n in (("attn_proj", attn), ("mlp_fc2", mlp)):
                key = f"tp/all_reduce/{tag}"
                want[key] = {k: v * (layers + n) // layers for k, v in base[key].items()}
            assert comm == want, recompute
