"""A rank's routed experts: one stacked weight per linear layer, run as one grouped GEMM or a loop.

Per-rank shapes: ``E_l = E / ep`` local experts, ``f = F / etp`` of each expert's width. fc1 is
``[E_l, halves f, h]`` (SwiGLU: ``[gate | up]`` halves split like the dense MLP's), fc2 ``[E_l, h,
f]``; biases ``[E_l, halves f]`` and ``[E_l, h]`` when the model has linear biases. Tokens arrive
sorted by local expert, ``counts[e]`` of them for expert ``e``. With ``etp > 1`` fc2's output is a
partial sum over the etp ranks (the dispatcher reduces it).

Each expert's weights are initialised as a parameter of their own named ``<name>.<global expert>``
(:class:`ExpertParam`), so every layout draws the same values. With FP8 the GEMMs are
:mod:`ptdp.engine.moe.expert_linear`'s (their splits read on the host), as under a zero-bubble
schedule, whose weight gradients wait in the chunk's queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.engine.comm import AxisGroup
from ptdp.engine.moe.expert_linear import (
    ExpertFP8,
    ExpertLinearFunction,
    ExpertPlan,
    expert_dims,
    expert_linear,
    grouped_supported,
)
from ptdp.engine.swiglu import swiglu
from ptdp.engine.tensor_parallel.linear import FP8Settings, WgradQueue
from ptdp.engine.tensor_parallel.sharding import GlobalParam, init_shard


@dataclass(frozen=True)
class ExpertParam:
    """A stacked expert parameter: ``num_experts`` global experts split over ep (dim 0 of the local
    tensor), each expert's own tensor described by ``expert`` (its split over etp)."""

    expert: GlobalParam
    num_experts: int

    def local_shape(self, ep: int, etp: int) -> tuple[int, ...]:
        return (self.num_experts // ep, *self.expert.local_shape(etp))


def make_expert_parameter(
    spec: ExpertParam, dtype: torch.dtype, *, ep: int = 1, ep_rank: int = 0, etp: int = 1, etp_rank: int = 0
) -> nn.Parameter:
    """An uninitialised stacked parameter of the rank's shape, tagged with ``spec``
    (``ptdp_expert``) and its initialisation (``ptdp_init``, :func:`init_expert_shard`); at ep =
    etp = 1 also with the :class:`~ptdp.engine.tensor_parallel.sharding.GlobalParam` of the whole
    stack, replicated over tp (``ptdp_global``)."""
    param = nn.Parameter(torch.empty(spec.local_shape(ep, etp), dtype=dtype))
    param.ptdp_expert = spec  # type: ignore[attr-defined]
    param.ptdp_init = partial(  # type: ignore[attr-defined]
        init_expert_shard, spec, ep_rank=ep_rank, ep=ep, etp_rank=etp_rank, etp=etp
    )
    if ep == etp == 1:
        param.ptdp_global = GlobalParam(spec.local_shape(1, 1), init=spec.expert.init)  # type: ignore[attr-defined]
    return param


def init_expert_shard(
    spec: ExpertParam,
    *,
    name: str,
    seed: int,
    std: float,
    num_layers: int,
    ep_rank: int,
    ep: int,
    etp_rank: int,
    etp: int,
) -> torch.Tensor:
    """The rank's stacked initial value (float32): expert ``g`` (global index) drawn as parameter
    ``<name>.<g>`` by :func:`~ptdp.engine.tensor_parallel.sharding.init_shard`, etp rank ``etp_rank``'s
    shard of it."""
    local = spec.num_experts // ep
    return torch.stack(
        [
            init_shard(
                spec.expert,
                name=f"{name}.{ep_rank * local + j}",
                seed=seed,
                std=std,
                num_layers=num_layers,
                tp_rank=etp_rank,
                tp_size=etp,
            )
            for j in range(local)
        ]
    )


class Experts(nn.Module):
    """The routed experts of one MoE layer on one rank (module docstring)."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden: int,
        ffn: int,
        swiglu: bool,
        bias: bool,
        approximate: str,
        dtype: torch.dtype,
        ep: int = 1,
        ep_rank: int = 0,
        etp: int = 1,
        etp_rank: int = 0,
        grouped: bool = False,
        fp8: FP8Settings | None = None,
        etp_group: AxisGroup | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        self.wgrad_queue = wgrad_queue
        self.explicit = fp8 is not None or (wgrad_queue is not None and wgrad_queue.enabled)
        """Whether the GEMMs are :class:`~ptdp.engine.moe.expert_linear.ExpertLinearFunction`'s (FP8,
        or weight gradients a zero-bubble schedule defers), else autograd's."""
        halves = 2 if swiglu else 1
        self.swiglu, self.approximate, self.grouped = swiglu, approximate, grouped
        self.fp8_fc1 = self.fp8_fc2 = None
        if fp8 is not None:  # fc1's and fc2's FP8 state (ptdp.engine.moe.expert_linear)
            group = etp_group if etp_group is not None else AxisGroup.single("etp")
            if group.size != etp or group.rank != etp_rank:
                raise ValueError(f"etp_group (size {group.size}, rank {group.rank}) is not etp {etp} rank {etp_rank}")
            (n1, k1), (n2, k2) = expert_dims(hidden, ffn, halves, group)
            self.fp8_fc1 = ExpertFP8(fp8.recipe, out_dim=n1, in_dim=k1, emulate=fp8.emulate, tag="moe_fc1")
            self.fp8_fc2 = ExpertFP8(fp8.recipe, out_dim=n2, in_dim=k2, emulate=fp8.emulate, tag="moe_fc2")
        self.num_local = num_experts // ep
        fc1 = ExpertParam(GlobalParam((halves * ffn, hidden), tp_dim=0, tp_groups=halves), num_experts)
        fc2 = ExpertParam(GlobalParam((hidden, ffn), tp_dim=1, init="scaled_normal"), num_experts)
        shards = dict(ep=ep, ep_rank=ep_rank, etp=etp, etp_rank=etp_rank)
        self.fc1_weight = make_expert_parameter(fc1, dtype, **shards)
        self.fc2_weight = make_expert_parameter(fc2, dtype, **shards)
        self.fc1_bias = self.fc2_bias = None
        if bias and etp > 1:
            raise ValueError("experts with linear biases at etp > 1 are not supported")
        if bias:
            self.fc1_bias = make_expert_parameter(
                ExpertParam(GlobalParam((halves * ffn,), tp_dim=0, tp_groups=halves, init="zeros"), num_experts),
                dtype,
                ep=ep,
                ep_rank=ep_rank,
                etp=etp,
            )
            self.fc2_bias = make_expert_parameter(
                ExpertParam(GlobalParam((hidden,), init="zeros"), num_experts), dtype, ep=ep, ep_rank=ep_rank
            )

    def forward(self, x: torch.Tensor, counts: torch.Tensor, splits: list[int] | None = None) -> torch.Tensor:
        """``x`` ``[N, h]`` sorted by local expert, ``counts[e]`` rows each (``splits``: the same on
        the host, else read once when the loop needs them); returns ``[N, h]``."""
        if splits is None and (self.explicit or not (self.grouped and grouped_supported(x, self.fc1_weight))):
            splits = counts.tolist()
        rows = None
        if self.fc1_bias is not None:
            rows = torch.repeat_interleave(
                torch.arange(self.num_local, device=x.device), counts, output_size=x.shape[0]
            )
        y = self._linear(x, self.fc1_weight, counts, splits, self.fp8_fc1)
        if rows is not None and self.fc1_bias is not None:
            y = y + self.fc1_bias[rows]
        if self.swiglu:
            y = swiglu(y)
        else:
            y = F.gelu(y, approximate=self.approximate)
        out = self._linear(y, self.fc2_weight, counts, splits, self.fp8_fc2)
        if rows is not None and self.fc2_bias is not None:
            out = out + self.fc2_bias[rows]
        return out

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, splits: list[int] | None, fp8
    ) -> torch.Tensor:
        """:func:`~ptdp.engine.moe.expert_linear.expert_linear` (autograd's weight gradient), or with
        FP8 or a queue that may defer, :class:`~ptdp.engine.moe.expert_linear.ExpertLinearFunction`."""
        if not self.explicit:
            return expert_linear(x, weight, counts, splits, self.grouped)
        assert splits is not None
        return ExpertLinearFunction.apply(x, weight, counts, splits, ExpertPlan(fp8, self.grouped, self.wgrad_queue))
