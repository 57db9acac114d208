"""Rotary position embeddings (RoPE; Su et al., "RoFormer", arXiv:2104.09864).

Each attention head's ``d`` channels form ``d / 2`` pairs ``(x_i, x_{i + d/2})`` (the "rotate
half" pairing); at position ``p`` pair ``i`` is turned by the angle ``p * base^(-2i / d)``:

    out_i         = x_i * cos - x_{i + d/2} * sin
    out_{i + d/2} = x_{i + d/2} * cos + x_i * sin

Applied to q and k (not v), the score ``q_m . k_n`` depends on positions only through ``m - n``.
Nothing is learned and nothing is communicated.

Under context parallelism local rows are turned by their *global* positions
(:mod:`ptdp.engine.context_parallel.load_balance`).
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.engine.context_parallel.load_balance import local_positions


class RotaryEmbedding(nn.Module):
    """Turns ``[b, heads, n, d]`` queries or keys by their positions; no parameters.

    ``n`` rows are positions ``0 .. n-1`` (``cp_size == 1``), or the global positions of cp rank
    ``cp_rank``'s two chunks of a sequence of ``s = n * cp_size`` tokens
    (:func:`~ptdp.engine.context_parallel.load_balance.local_positions`). Angles in float64,
    cached; the rotation runs in float32 for 16-bit inputs.
    """

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, seq_length: int, dtype: torch.dtype, device: torch.device, *, cp_rank: int = 0, cp_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of the angles of the ``seq_length`` local rows, each ``[n, d / 2]``
        (``n = seq_length``; with ``cp_size > 1`` the rows of cp rank ``cp_rank``'s global positions
        in a sequence of ``n * cp_size`` tokens)."""
        key = (seq_length, cp_rank, cp_size, dtype, device)
        if key not in self._cache:
            half = self.head_dim // 2
            inv_freq = self.base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / self.head_dim)
            positions = local_positions(seq_length * cp_size, cp_rank, cp_size)
            angles = positions.to(torch.float64).unsqueeze(1) * inv_freq
            self._cache[key] = (
                angles.cos().to(dtype=dtype, device=device),
                angles.sin().to(dtype=dtype, device=device),
            )
        return self._cache[key]

    def forward(self, x: torch.Tensor, *, cp_rank: int = 0, cp_size: int = 1) -> torch.Tensor:
        """``x`` ``[b, heads, n, d]`` turned by the positions of its rows (class docstring)."""
        work = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        cos, sin = self.cos_sin(x.shape[-2], work, x.device, cp_rank=cp_rank, cp_size=cp_size)
        return _turn(x, cos, sin, work)

    def forward_at(self, x: torch.Tensor, start: int, table_rows: int) -> torch.Tensor:
        """``x`` ``[b, heads, n, d]`` turned as the rows at positions ``start .. start + n - 1`` (no
        context parallelism; generation with a key/value cache): the angles are rows of the table
        of positions ``0 .. table_rows - 1``, so a cache of ``table_rows`` positions keeps one
        table instead of one per length. Raises ValueError when ``start + n > table_rows``."""
        n = x.shape[-2]
        if start < 0 or start + n > table_rows:
            raise ValueError(f"rotary positions {start}..{start + n - 1} are outside the table of {table_rows}")
        work = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        cos, sin = self.cos_sin(table_rows, work, x.device)
        return _turn(x, cos[start : start + n], sin[start : start + n], work)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """The "rotate half" turn of ``x [b, heads, n, d]`` by ``cos``, ``sin`` ``[n, d / 2]``, computed in
    ``work`` and returned in ``x``'s dtype."""
    x1, x2 = x.to(work).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
