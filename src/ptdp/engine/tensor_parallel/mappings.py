"""The two conjugate autograd operators of tensor parallelism, f and g.

Shoeybi et al., "Megatron-LM", arXiv:1909.08053, §3, Fig. 3:

- ``f`` (:func:`copy_to_tp`): identity in forward, all-reduce of the gradient over the tp axis in
  backward. Placed where a replicated activation enters a column-parallel layer.
- ``g`` (:func:`reduce_from_tp`): all-reduce over the tp axis in forward, identity in backward.
  Placed where the partial outputs of a row-parallel layer (or of the vocab-parallel embedding) are
  summed.

Both are the identity, with no autograd node at all, when the tp axis has size 1.
"""

from __future__ import annotations

import torch

from ptdp.engine.comm import AxisGroup, all_reduce


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
        out = x.contiguous().clone()
        all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def copy_to_tp(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """f: forward identity; backward all-reduce (sum) of the gradient, ``x.numel()`` elements, on tp.

    Shapes: any; output has the shape of ``x`` (replicated on every tp rank).
    """
    if axis.size == 1:
        return x
    return _CopyToTP.apply(x, axis, tag)


def reduce_from_tp(x: torch.Tensor, axis: AxisGroup, tag: str = "") -> torch.Tensor:
    """g: forward all-reduce (sum) of ``x`` over tp, ``x.numel()`` elements; backward identity.

    Shapes: any; input is this rank's partial sum, output the full sum (replicated).
    """
    if axis.size == 1:
        return x
    return _ReduceFromTP.apply(x, axis, tag)
