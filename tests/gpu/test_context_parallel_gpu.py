"""Context-parallel attention on CUDA (skipped without it): the fused flash-attention kernel path
(``aten._scaled_dot_product_flash_attention`` and its backward, bfloat16) against the float64
reference, on one GPU and across 2 GPUs over NCCL with both comm types and key/value messages of
16 MiB (larger than NCCL's buffers: a send completes only while its receive runs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist_helpers import PG_TIMEOUT
from helpers.nccl_helpers import run_nccl_workers
from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.context_parallel.cp_attention import context_parallel_attention
from ptdp.engine.context_parallel.load_balance import shard_sequence, unshard_sequence

pytestmark = pytest.mark.gpu
BF16 = dict(rtol=3e-2, atol=3e-2)


def _inputs(b: int, heads: int, kv_heads: int, s: int, d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (b, heads, s, d), "k": (b, kv_heads, s, d), "v": (b, kv_heads, s, d), "dout": (b, heads, s, d)}
    return {n: torch.randn(shape, generator=g, dtype=torch.float64).bfloat16() for n, shape in shapes.items()}


def _reference(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q, k, v = (x[n].double().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(x["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run(x: dict[str, torch.Tensor], axis: AxisGroup, comm: str, kernel: str, device) -> dict[str, torch.Tensor]:
    local = {n: shard_sequence(t, axis.rank, axis.size, dim=2).to(device) for n, t in x.items()}
    q, k, v = (local[n].clone().requires_grad_() for n in "qkv")
    out = context_parallel_attention(q, k, v, axis, comm, kernel=kernel)
    out.backward(local["dout"])
    return {"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_one_gpu_kernels_equal_the_reference(comm, kernel):
    x = _inputs(2, 8, 2, 512, 64)
    got = _run(x, AxisGroup.single("cp"), comm, kernel, torch.device("cuda"))
    for key, want in _reference(x).items():
        torch.testing.assert_close(got[key].double(), want, **BF16)


def _nccl_worker(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    axis = AxisGroup("cp", tuple(range(world)), rank, dist.group.WORLD, CommStats(), PG_TIMEOUT.total_seconds())
    x = _inputs(2, 16, 8, 4096, 128)  # keys + values of a rank: 2 * 2 * 8 * 2048 * 128 * 2 bytes = 16 MiB
    return {comm: _run(x, axis, comm, "auto", device) for comm in ("p2p", "all_gather")}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_both_comm_types():
    results = run_nccl_workers(_nccl_worker, 2)
    want = _reference(_inputs(2, 16, 8, 4096, 128))
    for comm in ("p2p", "all_gather"):
        for key, ref in want.items():
            got = unshard_sequence([results[r][comm][key] for r in range(2)], dim=2)
            torch.testing.assert_close(got.double(), ref, **BF16)
