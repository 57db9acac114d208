"""After backward: the tied-embedding sum, the data-parallel reduction, the tp sum of the
sequence-parallel parameters' gradients, and the global gradient norm with clipping, exact
whatever the layout, bucketing, compression or optimizer sharding."""

from __future__ import annotations

import torch
from torch import nn

from ptdp.engine.comm import all_reduce
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.sequence import is_sequence_parallel
from ptdp.engine.tensor_parallel.sharding import global_param


def finalize_grads(model: nn.Module, buffer: GradBuffer, groups: ParallelGroups) -> None:
    """Sum the tied embedding's gradient over the embedding group (first + last stage; its bucket
    is never reduced early), then finish the data-parallel reduction of every bucket, then sum the
    gradients of the sequence-parallel parameters over tp (:func:`sum_sequence_parallel_grads`).

    With ``shard_grads`` (ZeRO-2) the first two are swapped: the tied bucket's shard is summed.
    Communication: embedding all-reduce of the ``[V_pad / tp, h]`` gradient (pp > 1, tied; its
    shard with ``shard_grads``); dp x cp all-reduces or reduce-scatters of all buckets (Narayanan
    et al. SC21, §3.2); with sequence parallelism (or ``--qk-layernorm``) one tp all-reduce.
    """
    tied_embedding = getattr(model, "tied_embedding", None)  # a GPTModel stage or ModelChunks has it
    tied = tied_embedding() if tied_embedding is not None else None
    if tied is not None and groups.embedding.size > 1 and buffer.grads_sharded:
        buffer.finish()  # ZeRO-2: the tied bucket's shard holds the same rows on both stages
        all_reduce(buffer.bucket_shard(tied), groups.embedding, tag="tied_embedding")
    elif tied is not None and groups.embedding.size > 1:
        all_reduce(buffer.grad(tied), groups.embedding, tag="tied_embedding")
        buffer.finish()
    else:
        buffer.finish()
    sum_sequence_parallel_grads(buffer, groups)


def sum_sequence_parallel_grads(buffer: GradBuffer, groups: ParallelGroups) -> None:
    """Sum over tp the gradients of parameters marked ``ptdp_sequence_parallel``
    (:mod:`ptdp.engine.tensor_parallel.sequence`): applied to sequence-split activations, each tp rank's
    gradient covers its own positions only (Korthikanti et al. 2022, §4.2.2); the query/key norms of
    ``--qk-layernorm`` (any tp > 1), its own heads only.

    Runs after the data-parallel reduction (on this rank's shard when sharded): the sums over tp
    and dp commute. Communication: one tp all-reduce (tag ``sequence_parallel``) of all the marked
    gradients flattened together, when there are any.
    """
    if groups.tp.size == 1:
        return
    shard = buffer.shard_grads  # not None: sharded
    if shard is not None:
        grads = [
            shard[seg.shard_offset : seg.shard_offset + seg.hi - seg.lo]
            for seg in buffer.segments
            if is_sequence_parallel(seg.param)
        ]
    else:
        grads = [buffer.grad(p) for p in buffer.params if is_sequence_parallel(p)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, groups.tp, tag="sequence_parallel")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def counts_in_norm(param: nn.Parameter, groups: ParallelGroups) -> bool:
    """Whether this rank's copy of ``param`` is the one counted in the global norm.

    Tensor-parallel shards are all counted (they are disjoint); replicated parameters only on tp
    rank 0; the last stage's copy of a tied embedding not at all (the first stage counts it).
    """
    if getattr(param, "ptdp_tied_copy", False):
        return False
    return global_param(param).tp_dim is not None or groups.tp.rank == 0


def _sum_of_squares(model: nn.Module, buffer: GradBuffer, groups: ParallelGroups) -> torch.Tensor:
    sq = _local_squares(buffer, groups)
    if buffer.shard_grads is not None:  # the dp x cp ranks' shards add up
        all_reduce(sq, groups.dp_cp, tag="grad_norm")
    return sq


def _local_squares(buffer: GradBuffer, groups: ParallelGroups | None) -> torch.Tensor:
    """Sum of squares of this rank's reduced gradients counted in the norm (:func:`counts_in_norm`;
    every one without ``groups``, the experts'): the shard of a sharded buffer, else the whole."""
    shard = buffer.shard_grads  # not None: sharded
    if shard is not None:
        grads = [
            shard[seg.shard_offset : seg.shard_offset + seg.hi - seg.lo]
            for seg in buffer.segments
            if groups is None or counts_in_norm(seg.param, groups)
        ]
    else:
        grads = [buffer.grad(p) for p in buffer.params if groups is None or counts_in_norm(p, groups)]
    return _squares(grads, buffer.data.device)


def _expert_squares(experts: GradBuffer) -> torch.Tensor:
    """Sum of squares of this ep rank's expert gradients: the whole buffer, or sharded, this
    rank's shard all-reduced over the expert data-parallel group (``experts.dp``)."""
    sq = _local_squares(experts, None)
    return sq if experts.shard_grads is None else all_reduce(sq, experts.dp, tag="grad_norm")


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar: one norm per tensor (in its dtype, fused
    over the list; 16-bit gradients in float32), squared and added in float64."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if grads[0].dtype in (torch.bfloat16, torch.float16):
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).double()
    else:
        norms = torch.stack(torch._foreach_norm(grads)).double()
    return norms.pow(2).sum()


def global_grad_norm(
    model: nn.Module, buffer: GradBuffer, groups: ParallelGroups, experts: GradBuffer | None = None
) -> torch.Tensor:
    """Global L2 norm of all gradients of the model, every parameter counted once, as a float64
    0-dim tensor on the buffer's device (nan or inf if a gradient is; the same on every rank).

    Sums squares in float64 (sharded: over this rank's shard, all-reduced over dp x cp), then
    all-reduces 1 element over tp and pp; no cp reduction (gradients are equal over cp). With
    ``experts`` (expert parallelism) the squares of this rank's experts (sharded: summed over
    edp first), all-reduced over the ep x etp group (each rank's expert shards are its own; the
    edp replicas are equal), join before the pp sum.
    No host synchronisation.
    """
    sq = _sum_of_squares(model, buffer, groups)
    all_reduce(sq, groups.tp, tag="grad_norm")
    if experts is not None and groups.ep_etp is not None:
        sq = sq + all_reduce(_expert_squares(experts), groups.ep_etp, tag="grad_norm")
    all_reduce(sq, groups.pp, tag="grad_norm")
    return sq.sqrt()


def grad_norm_share(buffer: GradBuffer, groups: ParallelGroups, experts: GradBuffer | None = None) -> torch.Tensor:
    """This rank's share of the square of :func:`global_grad_norm`, a float64 0-dim tensor:
    summed over the world it gives the square (one world all-reduce in place of the norm's tp,
    dp x cp, edp, ep x etp and pp ones; summed in another order, so equal within rounding). A
    sharded buffer's shard counts on every rank; an unsharded buffer's gradients, which its dp
    replicas hold equally after the reduction, only on rank 0 of its dp group; each parameter as
    :func:`counts_in_norm` says (experts: every one). No communication."""
    zero = torch.zeros((), dtype=torch.float64, device=buffer.data.device)
    sq = _local_squares(buffer, groups) if buffer.shard_grads is not None or buffer.dp.rank == 0 else zero
    if experts is not None and groups.ep_etp is not None and (experts.shard_grads is not None or experts.dp.rank == 0):
        sq = sq + _local_squares(experts, None)
    return sq


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max_norm / (norm + 1e-6)`` where ``max_norm > 0`` and ``norm > max_norm``, else 1: a 0-dim
    tensor of ``norm``'s dtype on its device, chosen by ``torch.where`` (no host branch). A nan
    norm gives 1 and an inf norm 0 (such a step is skipped anyway)."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))


def clip_grads(buffer: GradBuffer, norm: torch.Tensor | float, max_norm: float) -> None:
    """Multiply every reduced gradient by :func:`clip_coefficient` (one kernel over the flat
    buffer or shard; the coefficient never leaves the device). Multiplying by exactly 1 where
    the norm is within ``max_norm`` leaves the gradients bitwise unchanged. A bf16 buffer
    (``--grad-reduce-in-bf16``) keeps its values: the coefficient scales the float32 copy the
    optimizer step makes (:attr:`GradBuffer.step_scale`), as it would scale float32 gradients."""
    if max_norm > 0:
        norm = torch.as_tensor(norm, dtype=torch.float64, device=buffer.data.device)
        coefficient = clip_coefficient(norm, max_norm)
        if buffer.reduced.dtype == torch.bfloat16 and buffer.uses_main_grad:
            buffer.step_scale = coefficient
        else:
            buffer.reduced.mul_(coefficient)


def clip_grad_norm(model: nn.Module, buffer: GradBuffer, groups: ParallelGroups, max_norm: float) -> float:
    """:func:`global_grad_norm`, then :func:`clip_grads`; returns the norm before clipping, read
    to the host (one synchronisation)."""
    norm = global_grad_norm(model, buffer, groups)
    clip_grads(buffer, norm, max_norm)
    return norm.item()
