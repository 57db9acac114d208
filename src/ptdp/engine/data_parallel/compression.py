"""How a gradient bucket is reduced over the data-parallel group: exactly, in 16 bits, or in 1 bit.

Every codec averages over the ``dp`` replicas (summing over cp) on the dp x cp gradient group
(counted on ``dp``). ``start`` issues the asynchronous collectives and returns a function that
waits and leaves the average in place (or this rank's shard in ``shard``). Payload per element:
``none`` 4 bytes, ``fp16``/``bf16`` 2, ``1bit`` 1/8 + 4/64 = 0.1875.

- ``fp16`` / ``bf16``: divide by dp *before* casting, so the sum overflows only where the mean
  does (float16 max 65,504: the step is then skipped as non-finite); cast back after.
- ``1bit``: signs with one float32 scale (mean absolute value) per block of :data:`ONE_BIT_BLOCK`
  elements, with error feedback in a per-rank residual that is part of the training state (Seide
  et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et al., "Error
  Feedback Fixes SignSGD", arXiv:1901.09847; exact warmup as Tang et al., "1-bit Adam",
  arXiv:2102.02888).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ptdp.engine.comm import AxisGroup, Handle, all_gather_async, all_reduce_async, reduce_scatter_async
from ptdp.layout.codecs import CODECS

ONE_BIT_BLOCK = 64
"""Elements sharing one scale in ``1bit``; the payload is 1/8 + 4/ONE_BIT_BLOCK bytes per element."""
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_BIT_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _constant(name: str, device: torch.device) -> torch.Tensor:
    """The bit weights or shifts on ``device``, copied there once (not once per bucket and step:
    a copy from pageable host memory would block the host)."""
    key = (name, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = {"weights": _BIT_WEIGHTS, "shifts": _BIT_SHIFTS}[name].to(device)
    return _ON_DEVICE[key]


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans ``[n]`` -> ``[ceil(n / 8)]`` uint8, most significant bit first."""
    padded = F.pad(bits.to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (padded * _constant("weights", bits.device)).sum(dim=1).to(torch.uint8)


def unpackbits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`packbits` for the last dim: ``[..., k]`` uint8 -> ``[..., n]`` bool."""
    bits = (packed.unsqueeze(-1) >> _constant("shifts", packed.device)) & 1
    return bits.flatten(-2)[..., :n].bool()


def start_reduction(
    codec: str,
    grad: torch.Tensor,
    axis: AxisGroup,
    *,
    shard: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    grad_scale: float | torch.Tensor = 1.0,
    blocks: torch.Tensor | None = None,
    average: bool = True,
    divisor: int | None = None,
) -> Callable[[], None]:
    """Start averaging ``grad`` (a flat fp32 bucket) over ``axis``; returns ``finish()``.

    ``divisor``: what averaging divides the sum by (default ``axis.size``; dp on the dp x cp
    group). ``average=False``: ``grad`` is already divided by dp, so the codec only sums.
    ``shard``: receive this rank's ``grad.numel() / dp`` slice (reduce-scatter) instead of the
    whole average in ``grad`` (all-reduce). ``residual``: the bucket's 1-bit error feedback, in
    unscaled units (``grad`` is ``grad_scale`` times the gradient; a 0-dim device tensor with
    float16). ``blocks``: 1-bit block sizes (:func:`block_sizes`; default :data:`ONE_BIT_BLOCK`).
    """
    dp = axis.size if divisor is None else divisor
    divide = dp if average else 1
    if codec == "none":
        if shard is not None:
            work = reduce_scatter_async(shard, grad, axis, tag="grads")
            return _then(work, partial(shard.div_, divide) if average else None)
        work = all_reduce_async(grad, axis, tag="grads")
        return _then(work, partial(grad.div_, divide) if average else None)
    if codec in _HALF:
        half = (grad.div(dp) if average else grad).to(_HALF[codec])
        if shard is not None:
            out = torch.empty(shard.numel(), dtype=half.dtype, device=half.device)
            work = reduce_scatter_async(out, half, axis, tag="grads")
            return _then(work, partial(shard.copy_, out))
        work = all_reduce_async(half, axis, tag="grads")
        return _then(work, partial(grad.copy_, half))
    if codec == "1bit":
        if shard is not None:
            raise ValueError("1-bit compression is not supported with the distributed optimizer")
        if residual is None:
            raise ValueError("1-bit compression needs the bucket's error-feedback residual")
        return _start_one_bit(grad, axis, residual, grad_scale, blocks, divide)
    raise ValueError(f"unknown gradient compression {codec!r}; expected one of {CODECS}")


def _then(work: Handle, after: Callable[[], object] | None) -> Callable[[], None]:
    """``finish()``: wait for ``work``, then run ``after`` (if any) on the reduced values."""

    def finish() -> None:
        work.wait()
        if after is not None:
            after()

    return finish


def block_sizes(segments: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Sizes (int64) of blocks of at most :data:`ONE_BIT_BLOCK` elements that never cross a
    segment (parameter) boundary, so a parameter's scales depend on its own gradient only (a
    tp-replicated parameter then compresses identically on every tp rank). Computed once per
    bucket by its owner."""
    out = []
    for length in segments:
        full, rest = divmod(length, ONE_BIT_BLOCK)
        out += [ONE_BIT_BLOCK] * full + ([rest] if rest else [])
    return torch.tensor(out, dtype=torch.int64, device=device)


def one_bit_scales(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Mean absolute value of each block of flat ``x`` (``blocks``: sizes from
    :func:`block_sizes`, summing to ``x.numel()``); ``[len(blocks)]`` float32. ``unsafe=True``:
    the lengths are not validated, which on a GPU would read them back to the host."""
    return (torch.segment_reduce(x.abs(), "sum", lengths=blocks, unsafe=True) / blocks).float()


def _per_element(scales: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """Each block's scale repeated over its elements: ``[..., len(blocks)]`` -> ``[..., n]``;
    ``output_size=n`` spares the host the read-back of ``blocks.sum()``."""
    return scales.repeat_interleave(blocks, dim=-1, output_size=n)


def _start_one_bit(
    grad: torch.Tensor,
    axis: AxisGroup,
    residual: torch.Tensor,
    grad_scale: float | torch.Tensor,
    blocks: torch.Tensor | None,
    divide: int,
) -> Callable[[], None]:
    n, dp = grad.numel(), axis.size
    blocks = blocks if blocks is not None else block_sizes([n], grad.device)
    # a tensor scale is never compared on the host (that would read it back): always applied
    scaled = isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0
    corrected = grad + residual * grad_scale if scaled else grad + residual
    scales = one_bit_scales(corrected, blocks)
    signs = corrected >= 0
    step = _per_element(scales, blocks, n).to(grad.dtype)
    kept = corrected - torch.where(signs, step, -step)
    residual.copy_(kept / grad_scale if scaled else kept)
    packed = packbits(signs)
    all_packed = torch.empty(dp * packed.numel(), dtype=torch.uint8, device=grad.device)
    all_scales = torch.empty(dp * scales.numel(), dtype=torch.float32, device=grad.device)
    works = [
        all_gather_async(all_packed, packed, axis, tag="grads"),
        all_gather_async(all_scales, scales, axis, tag="grads"),
    ]

    def finish() -> None:
        for work in works:
            work.wait()
        bits = unpackbits(all_packed.view(dp, -1), n)
        steps = _per_element(all_scales.view(dp, -1), blocks, n).to(grad.dtype)
        total = torch.where(bits, steps, -steps).sum(dim=0)
        grad.copy_(total.div_(divide) if divide != 1 else total)

    return finish
