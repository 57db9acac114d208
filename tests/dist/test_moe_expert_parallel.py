"""Expert parallelism's exchange inside an MoE layer (gloo, float64): with the experts split over ep
ranks, each rank's outputs, input gradients and router gradients equal one process's on the rank's
tokens, and each rank's expert gradients equal one process's summed over every rank's tokens; with
top-2 routing and balancing losses, with capacity drops, and with one token per rank (experts and
ranks that receive nothing)."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ExpertGroups, ParallelGroups
from ptdp.engine.moe.layer import MoELayer
from ptdp.layout.grid import ParallelLayout

D = torch.float64
CFG = ModelConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=12, params_dtype="float64", swiglu=True)
CASES = {
    "top2": (MoEConfig(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), (5, 2)),
    "capacity": (MoEConfig(num_experts=8, moe_router_topk=2, moe_expert_capacity_factor=0.5), (6, 2)),
    "one_token": (MoEConfig(num_experts=8, moe_router_topk=1), (1, 1)),
}


def _reference(moe: MoEConfig) -> MoELayer:
    layer = MoELayer(CFG, moe, D)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D) * 0.3)
    return layer


def _inputs(rank: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(*shape, 8, generator=g, dtype=D), torch.randn(*shape, 8, generator=g, dtype=D)


def ep_worker(rank: int, world: int, name: str) -> dict:
    moe, shape = CASES[name]
    groups = ParallelGroups.build(ParallelLayout(dp=world), PG_TIMEOUT)
    ep = AxisGroup("ep", groups.dp.ranks, groups.dp.rank, groups.dp.group, groups.stats)
    layer = MoELayer(CFG, moe, D, experts=ExpertGroups(ep, AxisGroup.single("etp"), ep))
    ref = _reference(moe)
    local = moe.num_experts // world
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        layer.router.copy_(ref.router)
        for name_, p in layer.experts.named_parameters():
            p.copy_(dict(ref.experts.named_parameters())[name_][mine])
    x, upstream = _inputs(rank, shape)
    x.requires_grad_()
    y = layer(x)
    (y * upstream).sum().backward()
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "router_grad": layer.router.grad,
        "expert_grads": {n: p.grad for n, p in layer.experts.named_parameters()},
        "comm": groups.stats.as_dict(),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_layer_equals_one_process(world, name):
    results = run_in_pool(ep_worker, world, name)
    moe, shape = CASES[name]
    ref = _reference(moe)
    expert_grads = {n: torch.zeros_like(p) for n, p in ref.experts.named_parameters()}
    local = moe.num_experts // world
    for rank, res in enumerate(results):
        ref.zero_grad(set_to_none=True)
        x, upstream = _inputs(rank, shape)
        x.requires_grad_()
        y = ref(x)
        (y * upstream).sum().backward()
        torch.testing.assert_close(res["y"], y.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(res["x_grad"], x.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(res["router_grad"], ref.router.grad, rtol=1e-12, atol=1e-14)
        for n, p in ref.experts.named_parameters():
            expert_grads[n] += p.grad
        assert res["comm"]["ep/all_to_all/moe_dispatch"]["calls"] == 1
        assert res["comm"]["ep/all_to_all/moe_combine"]["calls"] == 1
    for rank, res in enumerate(results):
        for n, g in res["expert_grads"].items():
            torch.testing.assert_close(g, expert_grads[n][rank * local : (rank + 1) * local], rtol=1e-12, atol=1e-14)
