"""The planner's bytes of an MoE layer's MLP against what ptdp's layer keeps for backward on each
rank of the expert grid (gloo, float64, forced balanced routing so that every rank receives its
balanced share): ep 2, etp 2 and ep 2 x etp 2, within 2% as for one process."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.activation_meter import SavedActivationMeter, parameter_storages
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ExpertGroups, ParallelGroups
from ptdp.engine.moe.layer import MoELayer
from ptdp.layout.grid import ParallelLayout
from ptdp.planner.memory.moe_activations import moe_mlp_activation_bytes

D = torch.float64
H, SEQ, BATCH = 64, 16, 4
CFG = ModelConfig(
    hidden_size=H, num_attention_heads=4, ffn_hidden_size=48, params_dtype="float64", swiglu=True, add_bias_linear=False
)
MOE = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_force_load_balancing=True)
#: (ep, etp) per world size
GRIDS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}


def _groups(world: int, ep: int, etp: int, stats) -> ExpertGroups:
    """ep x etp over the world's ranks, etp fastest."""
    rank = torch.distributed.get_rank()
    etp_ranks = [rank - rank % etp + i for i in range(etp)]
    ep_ranks = [rank % etp + etp * i for i in range(ep)]
    made = {}
    for ranks in [[e * etp + t for t in range(etp)] for e in range(ep)] + [
        [t + etp * e for e in range(ep)] for t in range(etp)
    ]:
        made[tuple(ranks)] = torch.distributed.new_group(ranks, timeout=PG_TIMEOUT) if len(ranks) > 1 else None
    world_group = torch.distributed.new_group(list(range(world)), timeout=PG_TIMEOUT)

    def axis(name: str, ranks: list[int], group) -> AxisGroup:
        return (
            AxisGroup(name, tuple(ranks), ranks.index(rank), group, stats)
            if len(ranks) > 1
            else AxisGroup.single(name, rank, stats)
        )

    return ExpertGroups(
        axis("ep", ep_ranks, made.get(tuple(ep_ranks))),
        axis("etp", etp_ranks, made.get(tuple(etp_ranks))),
        axis("ep", list(range(world)), world_group),
    )


def meter_worker(rank: int, world: int, ep: int, etp: int) -> float:
    groups = ParallelGroups.build(ParallelLayout(dp=world), PG_TIMEOUT)
    layer = MoELayer(CFG, MOE, D, experts=_groups(world, ep, etp, groups.stats))
    torch.manual_seed(rank)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(SEQ, BATCH, H, dtype=D, requires_grad=True)
    meter = SavedActivationMeter(parameter_storages(layer) | {x.untyped_storage().data_ptr()})
    with meter.hooks():
        layer(x)
    return float(meter.peak)


@pytest.mark.parametrize("world,ep,etp", [(w, e, t) for w, grids in GRIDS.items() for e, t in grids])
def test_moe_activation_bytes_per_rank_of_the_expert_grid(world, ep, etp):
    measured = run_in_pool(meter_worker, world, ep, etp)
    predicted = moe_mlp_activation_bytes(CFG, MOE, SEQ * BATCH, precision_bytes=8, router_bytes=8, etp=etp)
    for peak in measured:
        assert predicted == pytest.approx(peak, rel=0.02), (measured, predicted)
