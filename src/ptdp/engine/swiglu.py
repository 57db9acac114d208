"""SwiGLU as one autograd function: ``silu(gate) * up`` of ``x = [gate | up]`` (last dim ``2 F``),
keeping only ``x`` for backward (``2 F`` values per row) and computing the sigmoid again there, as a
fused kernel does; the unfused ops keep ``gate``'s silu and the product's inputs too (``4 F``)."""

from __future__ import annotations

import torch


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad * up * (sig + silu * (1 - sig))
        return torch.cat([d_gate, grad * silu], dim=-1)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[..., 2 F]`` -> ``[..., F]``; backward keeps ``x`` only."""
    return _SwiGLU.apply(x)
