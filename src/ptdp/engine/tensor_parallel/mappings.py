"""The two conjugate autograd operators of tensor parallelism, f and g.

Shoeybi et al., "Megatron-LM", arXiv:1909.08053, §3, Fig. 3:

- ``f`` (:func:`copy_to_tp`): identity in forward, all-reduce of the gradient over the tp axis in
  backward. Placed where a replicated activation enters a column-parallel layer.
- ``g`` (:func:`reduce_from_tp`): all-reduce over the tp axis in forward, identity in backward.
  Placed where the partial outputs of a row-parallel layer (or of the vocab-parallel embedding) are
  summed.

Both are the identity, with no autograd node, when the tp axis has size 1. ``g`` sums in place
when it may (the partial sums are a fresh output nobody keeps). The communicating functions run
outside ``torch.compile`` graphs, so every collective goes through :mod:`ptdp.engine.comm`.
"""

from __future__ import annotations

import torch

from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.engine.eager import outside_compile


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
        ctx.axis, ctx.tag = axis, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        all_reduce(grad, ctx.axis, tag=ctx.tag)
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
        if x.is_contiguous() and not (x.is_leaf and x.requires_grad):
            ctx.mark_dirty(x)  # autograd refuses backward if some node had saved x
            return all_reduce(x, axis, tag=tag)
        return all_reduce(x.contiguous() if not x.is_contiguous() else x.clone(), axis, tag=tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def copy_to_tp(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """f: forward identity; backward all-reduce (sum) of the gradient, ``x.numel()`` elements, on tp.

    Shapes: any; output has the shape of ``x`` (replicated on every tp rank).
    """
    if axis.size == 1:
        return x
    return _copy_to_tp(x, axis, tag)


def reduce_from_tp(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """g: forward all-reduce (sum) of ``x`` over tp, ``x.numel()`` elements; backward identity.

    Shapes: any; input is this rank's partial sum, output the full sum (replicated). A contiguous
    ``x`` that is not a leaf is summed in place and returned (marked dirty: if another autograd
    node had saved it, its backward raises instead of reading the sum).
    """
    if axis.size == 1:
        return x
    return _reduce_from_tp(x, axis, tag)


@outside_compile
def _copy_to_tp(x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
    return _CopyToTP.apply(x, axis, tag)


@outside_compile
def _reduce_from_tp(x: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
    return _ReduceFromTP.apply(x, axis, tag)
