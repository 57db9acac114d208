"""Memory model of one GPU: parameters, gradients, optimizer state, activations, fixed overhead.

All results are bytes on ONE tensor-parallel rank of a pipeline stage. Sources: [N21] Narayanan et
al., SC21, arXiv:2104.04473; [K22] Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198. Parameters and state: :mod:`ptdp.planner.memory.params`;
activations: :mod:`ptdp.planner.memory.activations`; the process's own: :mod:`ptdp.planner.memory.overhead`;
:func:`memory_breakdown` sums them.
"""

from __future__ import annotations

from functools import lru_cache

from ptdp.config.model import ModelConfig
from ptdp.layout.pipeline.partition import stage_layer_counts
from ptdp.layout.pipeline.placement import placement_of
from ptdp.planner.candidate import Candidate, MemoryBreakdown
from ptdp.planner.inputs.hardware import GPUType
from ptdp.planner.inputs.moe_model import MoEModel
from ptdp.planner.memory.activations import cached_rank_activation_bytes
from ptdp.planner.memory.fp8 import fp8_weight_copy_bytes
from ptdp.planner.memory.moe_params import expert_bytes_per_param, stage_counts
from ptdp.planner.memory.overhead import runtime_overhead_bytes
from ptdp.planner.memory.params import (
    even_stage_params,
    rank_state_bytes,
    stage_param_counts,
)
from ptdp.planner.memory.strategies import strategy_bytes_per_param

__all__ = ["activation_schedule", "memory_breakdown"]


def _candidate_stages(
    model: ModelConfig, layout: Candidate, layer_split: tuple[int, ...] | None, divisible_by: int
) -> list[tuple[int, int, int, int]]:
    """(pipeline rank, parameters on one tp rank, layers, routed experts in their own buffer) of every
    stage that can hold the most bytes (:func:`memory_breakdown`): the first and the last of an even
    split; with ``layer_split`` the first, the last and the lowest-ranked middle stage of each
    distinct layer count; of a planned MoE model every stage
    (:func:`_moe_stages`)."""
    placement = placement_of(layout.parallel.schedule)
    if isinstance(model, MoEModel):
        p = layout.parallel
        counted = (p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
        return _moe_stages(
            model, p.tp, p.pp, p.ep, p.etp, layer_split, divisible_by, layout.virtual_stages, counted, placement
        )
    if layer_split is None:
        first_params, last_params, per_stage = even_stage_params(model, layout.tp, layout.pp, divisible_by, placement)
        candidates = [(0, first_params, per_stage, 0)]
        if layout.pp > 1:
            candidates.append((layout.pp - 1, last_params, per_stage, 0))
        return candidates
    stage_params = stage_param_counts(
        model,
        layout.tp,
        layout.pp,
        make_vocab_size_divisible_by=divisible_by,
        layer_split=layer_split,
        placement=placement,
    )
    candidates, counts_seen = [], set()
    for rank, (n_params, n_layers) in enumerate(zip(stage_params, layer_split)):
        middle = 0 < rank < layout.pp - 1
        if not middle or n_layers not in counts_seen:
            candidates.append((rank, n_params, n_layers, 0))
        if middle:
            counts_seen.add(n_layers)
    return candidates


def _step_copy_beyond_activations(layout: Candidate, n_params: int, activations: float) -> float:
    """With bf16 gradients (``--grad-reduce-in-bf16``) the optimizer step makes a float32 copy of the
    gradients it applies (all ``n_params``, or the ``1/(dp cp)`` shard when sharded; Megatron-LM's
    optimizers do the same): bytes by which it exceeds the activations, freed before the step."""
    if not layout.bf16_grads:
        return 0.0
    sharded = layout.sharding_strategy != "no_shard"
    return max(0.0, 4.0 * n_params / (layout.shard_size if sharded else 1) - activations)


@lru_cache(maxsize=65536)
def _moe_stages(
    model: ModelConfig,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    layer_split: tuple[int, ...] | None,
    divisible_by: int,
    v: int,
    counted: tuple[bool, bool],
    placement: str = "looped",
) -> list[tuple[int, int, int, int]]:
    """:func:`_candidate_stages` of a planned MoE model: the first, the last and each other stage
    unlike those before it (:func:`~ptdp.planner.memory.moe_params.stage_counts`)."""
    dense, own = stage_counts(model, tp, pp, ep, etp, layer_split, divisible_by, v, counted, placement)
    layers = stage_layer_counts(model.num_layers, pp, layer_split)
    seen, out = set(), []
    for rank, row in enumerate(zip(dense, layers, own)):
        if rank in (0, pp - 1) or row not in seen:
            out.append((rank, *row))
        seen.add(row)
    return out


def activation_schedule(layout: Candidate) -> str:
    """The schedule :func:`memory_breakdown` counts a layout's activations under by default: gpipe
    for a layout running it, else 1f1b (a schedule running B and W apart is counted from its own order)."""
    return "gpipe" if layout.parallel.schedule == "gpipe" else "1f1b"


def memory_breakdown(
    model: ModelConfig,
    layout: Candidate,
    gpu: GPUType,
    *,
    overhead_bytes: float | None = None,
    gpus_per_node: int | None = None,
    schedule: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
) -> MemoryBreakdown:
    """Bytes on the most loaded GPU: the pipeline stage with the largest total (``stage``).

    params/grads/optimizer: the stage's parameters under the sharding strategy over ``dp * cp`` ranks,
    and with ep or etp > 1 its routed experts in their own buffer
    (:func:`~ptdp.planner.memory.moe_params.expert_bytes_per_param`), transients and FP8 weight copies included (:func:`rank_state_bytes`; grads: with bf16 gradients
    also the step's float32 copy beyond the activations); activations:
    :func:`rank_activation_bytes` (one cp rank); overhead: ``overhead_bytes``, by default the process's
    own (:func:`~ptdp.planner.memory.overhead.runtime_overhead_bytes` on nodes of ``gpus_per_node``,
    default the GPU's). ``gpu`` does not change the other bytes; the check ``total <= gpu.memory_bytes``
    is the caller's. ``schedule``: "1f1b" or "gpipe" (None: gpipe for a layout running it, else
    1f1b; a schedule running B and W apart is always counted from its own order).
    Only the first, the last and one middle stage per distinct layer count can be the maximum.
    """
    layer_split = layer_split if layer_split is not None else layout.layer_split
    schedule = schedule or activation_schedule(layout)
    candidates = _candidate_stages(model, layout, layer_split, make_vocab_size_divisible_by)
    rows = []
    per_param = strategy_bytes_per_param(
        layout.precision,
        layout.sharding_strategy,
        layout.shard_size,
        bf16_grads=layout.bf16_grads,
        optimizer=layout.optimizer_state,
    )
    per_param_total = sum(per_param)
    transients = layout.shard_size > 1 and layout.sharding_strategy in ("optim_grads", "optim_grads_params")
    expert_per_param = expert_bytes_per_param(layout.precision, layout.parallel) if layout.ep * layout.etp > 1 else None
    for rank, n_params, n_layers, n_experts in candidates:
        act = cached_rank_activation_bytes(model, layout, rank, n_layers, schedule, make_vocab_size_divisible_by)
        zero3 = layout.sharding_strategy == "optim_grads_params" and layout.shard_size > 1
        fp8_copies = fp8_weight_copy_bytes(
            model,
            layout.tp,
            # ZeRO-3 (float32 shards) under Transformer Engine: the gathered layers' FP8 copies only
            # (two at the peak, freed with them), or with FP8 weights those layers gathered in 1
            # byte instead of 2; ptdp train keeps every layer's copies until the step ends
            min(n_layers, 2) if zero3 and layout.fp8_recipe is None else n_layers,
            layout.fp8,
            param_gather=layout.fp8_param_gather,
            ep=layout.ep,
            etp=layout.etp,
            experts=layout.fp8_recipe is not None,
        )
        parts = (
            rank_state_bytes(
                model, layout, n_params, n_layers, per_param, stage=rank, divisible_by=make_vocab_size_divisible_by
            )
            if transients
            else None
        )
        state = sum(parts) if parts is not None else n_params * per_param_total
        experts = tuple(n_experts * x for x in expert_per_param) if expert_per_param else (0.0, 0.0, 0.0)
        copy = _step_copy_beyond_activations(layout, n_params, act)
        total = state + sum(experts) + fp8_copies + act + copy
        rows.append((total, rank, n_params, n_layers, act, fp8_copies, parts, copy, experts))
    _, rank, n_params, n_layers, act, fp8_copies, parts, copy, experts = max(rows, key=lambda row: row[0])
    params, grads, optimizer = parts or rank_state_bytes(
        model, layout, n_params, n_layers, per_param, stage=rank, divisible_by=make_vocab_size_divisible_by
    )
    return MemoryBreakdown(
        params=params + fp8_copies + experts[0],
        grads=grads + copy + experts[1],
        optimizer=optimizer + experts[2],
        activations=act,
        overhead=float(
            runtime_overhead_bytes(layout, gpus_per_node or gpu.gpus_per_node, model.tied)
            if overhead_bytes is None
            else overhead_bytes
        ),
        stage=rank,
    )
