"""Sequence parallelism: the g and ḡ operators of Korthikanti et al. 2022 [K22], arXiv:2205.05198, §4.2.2.

Outside the tensor-parallel regions (norms, residual adds, dropout, embedding output) each of the
``t`` tp ranks keeps only ``[s/t, b, h]``: rank r holds positions ``[r s/t, (r + 1) s/t)``.

- g, the region entry (before QKV, fc1, the output layer), replaces f: forward all-gather along
  the sequence ``[s/t, b, h] -> [s, b, h]``, backward reduce-scatter of the gradient.
- ḡ, the exit (after the attention projection, fc2, the vocab-parallel embedding), replaces the
  all-reduce: forward reduce-scatter ``[s, b, h] -> [s/t, b, h]``, backward all-gather.

The column-parallel linear fuses g with its GEMM, saving only the input shard
(:mod:`ptdp.engine.tensor_parallel.linear`). Gradients of parameters marked :data:`SEQUENCE_PARALLEL_ATTR` (also the per-head
query/key norms, whose tp ranks hold different heads) are summed over tp after backward
(:func:`ptdp.engine.data_parallel.grads.finalize_grads`). The sequence is dim 0 (:data:`SEQ_DIM`),
so the collectives copy nothing. Identity on a tp axis of size 1.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ptdp.engine.comm import AxisGroup, all_gather_async, reduce_scatter_async
from ptdp.engine.eager import outside_compile

SEQ_DIM = 0
"""The sequence dim of ``[s, b, h]`` activations."""
SEQUENCE_PARALLEL_ATTR = "ptdp_sequence_parallel"
"""Attribute set (True) on parameters whose gradients are partial sums over the sequence shards."""


class _AllGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
        ctx.axis, ctx.tag = axis, tag
        return start_sequence_gather(x, axis, tag)()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return start_sequence_reduce_scatter(grad, ctx.axis, ctx.tag)(), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
        ctx.axis, ctx.tag = axis, tag
        return start_sequence_reduce_scatter(x, axis, tag)()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return start_sequence_gather(grad, ctx.axis, ctx.tag)(), None, None


def start_sequence_gather(x: torch.Tensor, axis: AxisGroup, tag: str):
    """Start the all-gather of ``x [s/t, b, h]`` along the sequence (dim 0) into one new
    ``[s, b, h]`` buffer, rank r's block at rows ``[r s/t, (r + 1) s/t)``; returns a function that
    waits and gives that buffer. A contiguous ``x`` is sent as it is (no copy)."""
    part = x.contiguous()
    out = part.new_empty((axis.size * part.shape[0], *part.shape[1:]))
    work = all_gather_async(out, part, axis, tag=tag)

    def finish() -> torch.Tensor:
        work.wait()
        return out

    return finish


def start_sequence_reduce_scatter(y: torch.Tensor, axis: AxisGroup, tag: str):
    """Start the sum reduce-scatter of ``y [s, b, h]`` along the sequence (dim 0): rank r gets
    the sum of rows ``[r s/t, (r + 1) s/t)``; returns a function that waits and gives that
    ``[s/t, b, h]``. A contiguous ``y`` is sent as it is (its ``t`` blocks are already the
    chunks the collective expects: no copy)."""
    if y.shape[0] % axis.size:
        raise ValueError(
            f"reduce-scatter of {tuple(y.shape)} along the sequence (dim 0) over {axis.size} tp "
            f"ranks: {y.shape[0]} is not divisible by {axis.size}"
        )
    whole = y.contiguous()
    out = whole.new_empty((whole.shape[0] // axis.size, *whole.shape[1:]))
    work = reduce_scatter_async(out, whole, axis, tag=tag)

    def finish() -> torch.Tensor:
        work.wait()
        return out

    return finish


def all_gather_sequence(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """g of [K22] §4.2.2: forward all-gather along the sequence, backward reduce-scatter (sum).

    Per rank: ``x [s/t, b, h]`` (this rank's positions) -> ``[s, b, h]`` (replicated; one new
    buffer the collective writes into). Counted: forward one all-gather of ``s b h / t`` elements
    put in, backward one reduce-scatter of ``s b h``, both on tp.
    """
    if axis.size == 1:
        return x
    return _outside_compile(_AllGatherSequence.apply, x, axis, tag)


def reduce_scatter_sequence(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """ḡ of [K22] §4.2.2: forward reduce-scatter (sum) along the sequence, backward all-gather.

    Per rank: ``x [s, b, h]`` (this rank's partial sum over its tp shard) -> ``[s/t, b, h]``
    (the full sum at this rank's positions). Counted: forward one reduce-scatter of ``s b h``
    elements put in, backward one all-gather of ``s b h / t``, both on tp. Raises ValueError
    when ``s`` is not divisible by t.
    """
    if axis.size == 1:
        return x
    return _outside_compile(_ReduceScatterSequence.apply, x, axis, tag)


@outside_compile
def _outside_compile(apply, *args):
    """``apply(*args)`` run eagerly, never traced into a ``torch.compile`` graph: a compiled layer
    is split around it and its collectives are counted."""
    return apply(*args)


def mark_sequence_parallel(params: Iterable[nn.Parameter]) -> None:
    """Mark ``params`` as replicated parameters whose gradient on each tp rank is a partial sum
    (applied to sequence-split activations; or, ``--qk-layernorm``, to the rank's own heads):
    their gradients are summed over tp after backward."""
    for p in params:
        setattr(p, SEQUENCE_PARALLEL_ATTR, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is a partial sum over the sequence shards of the tp ranks."""
    return getattr(param, SEQUENCE_PARALLEL_ATTR, False)


def sequence_shard(length: int, axis: AxisGroup) -> slice:
    """The positions ``[r L/t, (r + 1) L/t)`` of a sequence of ``length`` that tp rank r holds."""
    if length % axis.size:
        raise ValueError(
            f"a sequence of {length} positions cannot be split over {axis.size} tp ranks "
            f"(rule: s % tp == 0 with sequence parallelism)"
        )
    per = length // axis.size
    return slice(axis.rank * per, (axis.rank + 1) * per)
