"""Memory model of one GPU: parameters, gradients, optimizer state, activations, fixed overhead.

All results are bytes on ONE tensor-parallel rank of a pipeline stage (the unit that the GPU of
that stage holds). Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473; [K22] Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198.

The parts: parameters per stage, bytes per parameter and the state of a rank under its sharding
strategy are :mod:`ptdp.planner.memory.params`; the activations a pipeline rank keeps at its peak
([K22] §4, microbatches in flight) are :mod:`ptdp.planner.memory.activations`. This module puts them
together for the most loaded GPU (:func:`memory_breakdown`).
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.planner.candidate import Candidate, MemoryBreakdown
from ptdp.planner.inputs.hardware import GiB, GPUType
from ptdp.planner.memory.activations import cached_rank_activation_bytes
from ptdp.planner.memory.fp8 import fp8_weight_copy_bytes
from ptdp.planner.memory.params import (
    even_stage_params,
    rank_state_bytes,
    stage_param_counts,
)
from ptdp.planner.memory.strategies import strategy_bytes_per_param

__all__ = ["DEFAULT_OVERHEAD_BYTES", "memory_breakdown"]

#: Default fixed overhead per GPU (bytes): CUDA context and kernel images (~0.5 GiB on A100/H100),
#: NCCL buffers of the 3-5 communicators a rank joins (tp, pp, dp, embedding, world; a few hundred
#: MiB each at default NCCL_BUFFSIZE and channel counts), cuBLAS workspaces, and caching-allocator
#: fragmentation at the activation peak. 2 GiB is deliberately round: large enough that a plan
#: listed as fitting is not at the edge, small next to the 40-141 GiB of current GPUs.
DEFAULT_OVERHEAD_BYTES = 2 * GiB


def _candidate_stages(
    model: ModelConfig, layout: Candidate, layer_split: tuple[int, ...] | None, divisible_by: int
) -> list[tuple[int, int, int]]:
    """(pipeline rank, parameters on one tp rank, layers) of every stage that can hold the most
    bytes (:func:`memory_breakdown`): the first and the last of an even split; with ``layer_split``
    the first, the last and the lowest-ranked middle stage of each distinct layer count."""
    if layer_split is None:
        first_params, last_params, per_stage = even_stage_params(model, layout.tp, layout.pp, divisible_by)
        candidates = [(0, first_params, per_stage)]
        if layout.pp > 1:
            candidates.append((layout.pp - 1, last_params, per_stage))
        return candidates
    stage_params = stage_param_counts(
        model, layout.tp, layout.pp, make_vocab_size_divisible_by=divisible_by, layer_split=layer_split
    )
    candidates, counts_seen = [], set()
    for rank, (n_params, n_layers) in enumerate(zip(stage_params, layer_split)):
        middle = 0 < rank < layout.pp - 1
        if not middle or n_layers not in counts_seen:
            candidates.append((rank, n_params, n_layers))
        if middle:
            counts_seen.add(n_layers)
    return candidates


def memory_breakdown(
    model: ModelConfig,
    layout: Candidate,
    gpu: GPUType,
    *,
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
) -> MemoryBreakdown:
    """Bytes on the most loaded GPU: the pipeline stage with the largest total (``stage``).

    params/grads/optimizer: exact stage parameter count under the sharding strategy over
    ``dp * cp`` ranks, transients included (:func:`rank_state_bytes`; params with
    precision "fp8" also hold the FP8 weight copies, :func:`ptdp.planner.memory.fp8.fp8_weight_copy_bytes`); activations:
    :func:`rank_activation_bytes` (one cp rank); overhead: ``overhead_bytes`` (default
    :data:`DEFAULT_OVERHEAD_BYTES`). ``gpu`` does not change the bytes (it is part of the call for
    symmetry with the time model); the capacity check ``total <= gpu.memory_bytes`` is the
    caller's. ``schedule``: "1f1b" (interleaved when ``layout.virtual_stages > 1``) or "gpipe".

    With an even split only the first and the last stage can be the maximum (the first holds the
    most microbatches in flight and the embedding, the last the output layer and logits; middle
    stages hold no more than the first), so the cost is O(1) in pp. With ``layer_split`` (default:
    ``layout.layer_split``) the first, the last and, for each distinct layer count of the middle
    stages, the lowest-ranked of them are evaluated (a middle stage holds no more microbatches in
    flight than the ones before it, and its parameters depend only on its layers).
    """
    layer_split = layer_split if layer_split is not None else layout.layer_split
    candidates = _candidate_stages(model, layout, layer_split, make_vocab_size_divisible_by)
    rows = []
    per_param = strategy_bytes_per_param(layout.precision, layout.sharding_strategy, layout.shard_size)
    per_param_total = sum(per_param)
    transients = layout.shard_size > 1 and layout.sharding_strategy in ("optim_grads", "optim_grads_params")
    for rank, n_params, n_layers in candidates:
        act = cached_rank_activation_bytes(model, layout, rank, n_layers, schedule, make_vocab_size_divisible_by)
        fp8_copies = fp8_weight_copy_bytes(model, layout.tp, n_layers, layout.precision)
        parts = (
            rank_state_bytes(
                model, layout, n_params, n_layers, per_param, stage=rank, divisible_by=make_vocab_size_divisible_by
            )
            if transients
            else None
        )
        state = sum(parts) if parts is not None else n_params * per_param_total
        rows.append((state + fp8_copies + act, rank, n_params, n_layers, act, fp8_copies, parts))
    _, rank, n_params, n_layers, act, fp8_copies, parts = max(rows, key=lambda row: row[0])  # the first largest
    params, grads, optimizer = parts or rank_state_bytes(
        model, layout, n_params, n_layers, per_param, stage=rank, divisible_by=make_vocab_size_divisible_by
    )
    return MemoryBreakdown(
        params=params + fp8_copies,
        grads=grads,
        optimizer=optimizer,
        activations=act,
        overhead=float(overhead_bytes),
        stage=rank,
    )
