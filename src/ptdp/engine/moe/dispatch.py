"""The expert-parallel token exchange: routed tokens to the ranks holding their experts and back.

``alltoall``: each rank first tells every peer how many rows it sends (an ``all_to_all_single`` of
``ep`` counts; the host reads them, one synchronisation per exchange), then the rows travel by
``all_to_all_single`` with those uneven splits (:func:`ptdp.engine.comm.all_to_all`, axis ``ep``).
The backward of an exchange is the exchange of the gradients with the splits swapped.
"""

from __future__ import annotations

import torch

from ptdp.engine.comm import AxisGroup, all_to_all


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, in_splits, out_splits, tag):
        ctx.axis, ctx.splits, ctx.tag = axis, (in_splits, out_splits), tag
        return all_to_all(x, axis, in_splits=in_splits, out_splits=out_splits, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        back = all_to_all(
            grad.contiguous(), ctx.axis, in_splits=out_splits, out_splits=in_splits, tag=f"{ctx.tag}_grad"
        )
        return back, None, None, None, None


def exchange(
    x: torch.Tensor, axis: AxisGroup, in_splits: list[int], out_splits: list[int], tag: str = ""
) -> torch.Tensor:
    """:func:`ptdp.engine.comm.all_to_all` of ``x``'s rows, differentiable: backward sends the
    gradients back with the splits swapped (tag ``<tag>_grad``)."""
    if axis.size == 1:
        return x
    return _AllToAll.apply(x, axis, list(in_splits), list(out_splits), tag)


def exchange_counts(counts: torch.Tensor, axis: AxisGroup, tag: str = "counts") -> list[int]:
    """What every peer sends this rank, given what this rank sends each (``counts`` ``[axis.size]``
    int64): ``[axis.size]`` row counts, read on the host (a synchronisation)."""
    if axis.size == 1:
        return counts.tolist()
    received = all_to_all(counts, axis, in_splits=[1] * axis.size, out_splits=[1] * axis.size, tag=tag)
    return received.tolist()
