"""Which kernel computes a block of context-parallel attention: the explicit one of
:mod:`.blockwise` (``"math"``) or a fused flash-attention kernel (``"fused"``) that returns the
log-sum-exp and takes the final output and log-sum-exp in its backward.

The fused kernels are ATen's ``_scaled_dot_product_flash_attention`` (CUDA: 16-bit, head dim a
multiple of 8 up to 256) and ``_scaled_dot_product_flash_attention_for_cpu`` (any float dtype),
called directly for their log-sum-exp; given the final output, their backward returns a block's
gradient terms (Dao 2023, "FlashAttention-2", Algorithm 2). Causal only for square blocks;
grouped-query heads as repeated key/value heads; dropout only on the math kernel.

``"auto"`` picks the fused kernel on CUDA for 16-bit inputs and the math one otherwise.
"""

from __future__ import annotations

import torch

from ptdp.engine.context_parallel.blockwise import (
    Partial,
    attention_block,
    attention_block_backward,
    compute_dtype,
)

KERNELS = ("auto", "math", "fused")


def choose(kernel: str, q: torch.Tensor) -> str:
    """``"math"`` or ``"fused"`` for ``kernel`` (one of :data:`KERNELS`) and queries like ``q``.

    Raises:
        ValueError: an unknown kernel, or ``"fused"`` where no fused kernel takes these inputs.
    """
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {KERNELS}")
    d, cuda = q.shape[-1], q.device.type == "cuda"
    fused_ok = (not cuda) or (q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256)
    if kernel == "auto":
        return "fused" if cuda and fused_ok else "math"
    if kernel == "fused" and not fused_ok:
        raise ValueError(
            f"no fused flash-attention kernel for {q.dtype} inputs with head dim {d} on CUDA "
            "(16-bit inputs, head dim a multiple of 8 up to 256)"
        )
    return kernel


def _repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _unrepeat(grad: torch.Tensor, group: int) -> torch.Tensor:
    return grad if group == 1 else grad.unflatten(1, (grad.shape[1] // group, group)).sum(2)


def _check_causal(causal: bool, n: int, m: int) -> None:
    if causal and n != m:
        raise ValueError(f"the fused kernel takes causal blocks only when square, got {n} queries and {m} keys")


def _check_dropout(drop: torch.Tensor | None, kernel: str) -> None:
    if drop is not None and kernel != "math":
        raise ValueError(f"attention dropout runs only on the math kernel, not {kernel!r}")


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: str,
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> Partial:
    """:class:`Partial` of ``q`` ``[b, heads, n, d]`` over ``k, v`` ``[b, kv_heads, m, d]`` in the
    compute dtype; ``causal`` True for a square diagonal block, False for a full one; ``drop``
    ``[b, heads, n, m]`` (True: dropped) and ``dropout_p``: the block's attention dropout (math
    kernel only)."""
    _check_dropout(drop, kernel)
    if kernel == "math":
        return attention_block(q, k, v, causal=causal, scale=scale, drop=drop, dropout_p=dropout_p)
    _check_causal(causal, q.shape[2], k.shape[2])
    group, cd = q.shape[1] // k.shape[1], compute_dtype(q.dtype)
    k, v = _repeat(k, group), _repeat(v, group)
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return Partial(out.to(cd), lse.to(cd))


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: str,
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's ``(dq, dk, dv)`` in the compute dtype, from the rows' final ``out`` and
    ``lse`` (as :func:`~ptdp.engine.context_parallel.blockwise.attention_block_backward`)."""
    _check_dropout(drop, kernel)
    if kernel == "math":
        return attention_block_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, drop=drop, dropout_p=dropout_p
        )
    _check_causal(causal, q.shape[2], k.shape[2])
    group, cd = q.shape[1] // k.shape[1], compute_dtype(q.dtype)
    kr, vr = _repeat(k, group), _repeat(v, group)
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    if q.device.type == "cuda":
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # read only with dropout
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            kr,
            vr,
            out,
            lse.float().contiguous(),
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out, lse.to(cd).contiguous(), 0.0, causal, scale=scale
        )
    return dq.to(cd), _unrepeat(dk, group).to(cd), _unrepeat(dv, group).to(cd)
