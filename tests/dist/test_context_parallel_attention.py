"""Attention across context-parallel ranks (gloo, cp groups of 2 and 4 ranks) against plain causal
attention of the whole sequence in one process: outputs and q/k/v gradients in float64 at 1e-12,
both ``--cp-comm-type``s, multi-head and grouped-query, the math kernel and the fused one (CPU's
flash-attention operators); the cp bytes each rank counted equal the docstring's formula; the
ring's batches are the program checked under NCCL's rules. Every case of a world size runs in one
job."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.host_sync import count_host_syncs
from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.context_parallel.cp_attention import context_parallel_attention, cp_attention_comm
from ptdp.engine.context_parallel.load_balance import shard_sequence, unshard_sequence
from ptdp.engine.context_parallel.ring import ring_groups
from ptdp.layout.pipeline.nccl_model import Op, simulate_nccl

B, D = 2, 8
# (comm type, heads, kv heads, dtype, chunk length c: s = 2 C c, kernel)
CASES = (
    [
        (comm, heads, kv, torch.float64, c, "math")
        for comm in ("p2p", "all_gather")
        for heads, kv in ((4, 4), (6, 2))
        for c in (1, 3)
    ]
    + [(comm, 6, 2, torch.float64, 3, "fused") for comm in ("p2p", "all_gather")]
    + [(comm, 4, 2, torch.bfloat16, 4, "math") for comm in ("p2p", "all_gather")]
)


def inputs(heads: int, kv_heads: int, s: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (B, heads, s, D), "k": (B, kv_heads, s, D), "v": (B, kv_heads, s, D), "dout": (B, heads, s, D)}
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape in shapes.items()}


def cp_worker(rank: int, world: int) -> list[dict]:
    stats = CommStats()
    group = dist.new_group(list(range(world)), timeout=PG_TIMEOUT)
    axis = AxisGroup("cp", tuple(range(world)), rank, group, stats, PG_TIMEOUT.total_seconds())
    results = []
    for i, (comm, heads, kv_heads, dtype, c, kernel) in enumerate(CASES):
        full = inputs(heads, kv_heads, 2 * world * c, seed=i)
        local = {name: shard_sequence(t, rank, world, dim=2).to(dtype) for name, t in full.items()}
        q, k, v = (local[name].clone().requires_grad_() for name in "qkv")
        stats.reset()
        stats.p2p_log = []
        with count_host_syncs() as syncs:
            out = context_parallel_attention(q, k, v, axis, comm, kernel=kernel)
            posted, stats.p2p_log = {"forward": stats.p2p_log}, []
            out.backward(local["dout"])
        posted["backward"], stats.p2p_log = stats.p2p_log, None
        results.append(
            {
                "out": out.detach(),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
                "comm": stats.as_dict(),
                "posted": {phase: [ops for _, ops in log] for phase, log in posted.items()},
                "host_syncs": syncs.calls,
            }
        )
    return results


@functools.cache
def cp_results(world: int) -> list[list[dict]]:
    return run_in_pool(cp_worker, world)


def reference(heads: int, kv_heads: int, s: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    full = inputs(heads, kv_heads, s, seed)
    q, k, v = (full[name].to(dtype).double().requires_grad_() for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    out.backward(full["dout"].to(dtype).double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_plain_causal_attention(world):
    results = cp_results(world)
    for i, (comm, heads, kv_heads, dtype, c, kernel) in enumerate(CASES):
        want = reference(heads, kv_heads, 2 * world * c, i, dtype)
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
        case = f"{comm} {kernel} heads={heads}/{kv_heads} c={c}"
        for key, ref in want.items():
            got = unshard_sequence([results[r][i][key] for r in range(world)], dim=2)
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m, key=key, case=case: f"{case} {key}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_bytes_equal_the_formula(world):
    results = cp_results(world)
    for i, (comm, heads, kv_heads, dtype, c, _) in enumerate(CASES):
        want = cp_attention_comm(
            comm, batch=B, kv_heads=kv_heads, local_seq=2 * c, head_dim=D, cp_size=world, dtype=dtype
        )
        assert want  # a formula that could be empty would prove nothing
        for r in range(world):
            assert results[r][i]["comm"] == want, (comm, heads, kv_heads, dtype, r)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_never_waits_on_the_device(world):
    """No call that would synchronise the host with a GPU (reading a value, a blocking copy) in a
    forward and backward of either variant (counted by the CPU shim of ``helpers.host_sync``)."""
    for rank_results in cp_results(world):
        assert [case["host_syncs"] for case in rank_results] == [[]] * len(CASES)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_posts_its_program_which_is_deadlock_free_under_nccl_rules(world):
    """What the p2p variant really posted, batch by batch, is :func:`ring_groups` (checked
    without processes for more sizes), and those batches complete under the NCCL model."""
    results = cp_results(world)
    for i, (comm, *_) in enumerate(CASES):
        for phase in ("forward", "backward"):
            posted = [results[r][i]["posted"][phase] for r in range(world)]
            if comm == "all_gather":
                assert posted == [[]] * world
                continue
            assert posted == [ring_groups(r, world, phase) for r in range(world)]
            simulate_nccl(
                [
                    [SimpleNamespace(communicator="cp", ops=[Op(*op) for op in group]) for group in program]
                    for program in posted
                ]
            )
