"""How a gradient bucket is reduced over the data-parallel group: exactly, in 16 bits, or in 1 bit.

Every codec averages the bucket over the ``dp`` replicas and only ever communicates on the DP
axis. ``start`` issues the (asynchronous) collectives and returns a function that, once called,
waits for them and leaves the average in place (or, for the distributed optimizer, this rank's
shard of it in ``shard``). Payload per rank and step (counted by :mod:`ptdp.comm`): ``none`` 4
bytes per element (fp32), ``fp16``/``bf16`` 2, ``1bit`` 1/8 plus 4 bytes per bucket.

- ``fp16`` / ``bf16``: divide by dp *before* casting, so a sum of large gradients cannot
  overflow the 16-bit range; cast back after the reduction.
- ``1bit``: signs with one scale per bucket (mean absolute value), with error feedback: the
  part of the gradient the sign cannot express is kept in a per-rank residual and added to the
  next step's gradient (Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014;
  Tang et al., "1-bit Adam", arXiv:2102.02888). The residual is training state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ptdp.comm import AxisGroup, all_gather_async, all_reduce_async, reduce_scatter_async

CODECS = ("none", "fp16", "bf16", "1bit")
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_BIT_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans ``[n]`` -> ``[ceil(n / 8)]`` uint8, most significant bit first."""
    padded = F.pad(bits.to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (padded * _BIT_WEIGHTS.to(bits.device)).sum(dim=1).to(torch.uint8)


def unpackbits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`packbits` for the last dim: ``[..., k]`` uint8 -> ``[..., n]`` bool."""
    bits = (packed.unsqueeze(-1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return bits.flatten(-2)[..., :n].bool()


def start_reduction(codec: str, grad: torch.Tensor, axis: AxisGroup, *, shard: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> Callable[[], None]:
    """Start averaging ``grad`` (a flat fp32 bucket) over ``axis``; returns ``finish()``.

    ``shard`` (distributed optimizer): receive only this rank's ``grad.numel() / dp`` slice of the
    average there (reduce-scatter) instead of the whole average in ``grad`` (all-reduce).
    ``residual``: the 1-bit error-feedback buffer of this bucket (same shape as ``grad``).
    """
    dp = axis.size
    if codec == "none":
        if shard is not None:
            work = reduce_scatter_async(shard, grad, axis, tag="grads")
            return lambda: (work.wait(), shard.div_(dp))
        work = all_reduce_async(grad, axis, tag="grads")
        return lambda: (work.wait(), grad.div_(dp))
    if codec in _HALF:
        half = grad.div(dp).to(_HALF[codec])
        if shard is not None:
            out = torch.empty(shard.numel(), dtype=half.dtype, device=half.device)
            work = reduce_scatter_async(out, half, axis, tag="grads")
            return lambda: (work.wait(), shard.copy_(out))
        work = all_reduce_async(half, axis, tag="grads")
        return lambda: (work.wait(), grad.copy_(half))
    if codec == "1bit":
        if shard is not None:
            raise ValueError("1-bit compression is not supported with the distributed optimizer")
        return _start_one_bit(grad, axis, residual)
    raise ValueError(f"unknown gradient compression {codec!r}; expected one of {CODECS}")


def _start_one_bit(grad: torch.Tensor, axis: AxisGroup, residual: torch.Tensor) -> Callable[[], None]:
    n, dp = grad.numel(), axis.size
    corrected = grad + residual
    scale = corrected.abs().mean().reshape(1).float()
    signs = corrected >= 0
    residual.copy_(corrected - torch.where(signs, scale, -scale))
    packed = packbits(signs)
    all_packed = torch.empty(dp * packed.numel(), dtype=torch.uint8, device=grad.device)
    all_scales = torch.empty(dp, dtype=torch.float32, device=grad.device)
    works = [all_gather_async(all_packed, packed, axis, tag="grads"),
             all_gather_async(all_scales, scale, axis, tag="grads")]

    def finish() -> None:
        for work in works:
            work.wait()
        bits = unpackbits(all_packed.view(dp, -1), n)
        values = torch.where(bits, 1.0, -1.0).to(grad.dtype) * all_scales.to(grad.dtype).unsqueeze(1)
        grad.copy_(values.sum(dim=0).div_(dp))

    return finish
