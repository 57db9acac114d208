"""The scales of a sharded GEMM operand, computed over the same elements on every layout.

A GEMM's three dims are the tokens T, its outputs N and its inputs K. A rank holds part of each:
:class:`GemmDim` says which global indices (``ranges``, in local order) and which ranks hold the
others (``axes``). An operand is a 2-D ``[R, K']`` view whose rows and columns are two of those
dims (``x [T, K]``, ``W [N, K]``, ``dy [T, N]`` and their transposes). :func:`shared_amax` gives
the float32 amax of each scaled group (:func:`ptdp.engine.fp8.compute_amax`'s groups, over the
global tensor) for this rank's elements, all-reduced (MAX) over exactly the ranks holding other
elements of the same groups: ``tensor`` every axis splitting either dim, ``row`` the axes
splitting the columns, tiles the axes splitting a tiled dim whose shard boundaries cut a tile.
NaN becomes inf before the reduction (both give scale 1). The tokens' dim: ``[s, b]`` rows
flattened sequence-major, the cp rank's two chunks of the sequence
(:func:`ptdp.engine.context_parallel.load_balance.chunk_ids`), :func:`token_dim`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.engine.context_parallel.load_balance import chunk_ids
from ptdp.engine.fp8 import TILE, Granularity, compute_amax


@dataclass(frozen=True)
class GemmDim:
    """One GEMM dim as this rank holds it: its global ``length``, the global ``[start, stop)``
    ``ranges`` of its local indices in local order (empty: the whole dim, in order), and the
    ``axes`` whose ranks hold the rest (empty: none)."""

    length: int
    ranges: tuple[tuple[int, int], ...] = ()
    axes: tuple[AxisGroup, ...] = field(default=())

    @property
    def split(self) -> bool:
        """Whether other ranks hold other indices of this dim."""
        return any(axis.size > 1 for axis in self.axes)

    def cuts(self, tile: int) -> bool:
        """Whether a tile of ``tile`` global indices is split between this rank and another."""
        return self.split and any(a % tile or (b % tile and b != self.length) for a, b in self.ranges)

    def ids(self, device: torch.device) -> torch.Tensor:
        """Global index of each local index (int64)."""
        spans = self.ranges or ((0, self.length),)
        return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


def whole(length: int) -> GemmDim:
    """A dim this rank holds entirely."""
    return GemmDim(length)


def split_dim(length: int, ranges: Sequence[tuple[int, int]], axis: AxisGroup) -> GemmDim:
    """A dim of ``length`` of which this rank holds ``ranges`` and ``axis``'s ranks the rest."""
    return GemmDim(length, tuple(ranges), (axis,) if axis.size > 1 else ())


def token_dim(local_seq: int, batch: int, cp: AxisGroup | None) -> GemmDim:
    """The tokens of a ``[s / C, b]`` microbatch flattened sequence-major: of the global
    ``[s, b]`` rows, the two load-balanced chunks of cp rank r (C = ``cp.size``)."""
    if cp is None or cp.size == 1:
        return GemmDim(local_seq * batch)
    half = local_seq // 2
    ranges = tuple((c * half * batch, (c + 1) * half * batch) for c in chunk_ids(cp.rank, cp.size))
    return GemmDim(local_seq * cp.size * batch, ranges, (cp,))


def all_max(amax: torch.Tensor, axes: Sequence[AxisGroup], tag: str) -> torch.Tensor:
    """``amax`` all-reduced (MAX) over ``axes`` (those of size > 1), NaN made inf first; counted
    under ``tag``."""
    axes = [axis for axis in axes if axis.size > 1]
    if not axes:
        return amax
    amax = torch.nan_to_num(amax, nan=float("inf"))
    for axis in axes:
        all_reduce(amax, axis, op="max", tag=tag)
    return amax


def shared_amax(x: torch.Tensor, rows: GemmDim, cols: GemmDim, granularity: Granularity, tag: str) -> torch.Tensor:
    """float32 amaxes of the operand ``x [R, K]`` (rows and columns as ``rows`` and ``cols`` say)
    over the global tensor's groups: ``[]`` (tensor), ``[R, 1]`` (row), or the local tiles of
    :func:`ptdp.engine.fp8.compute_amax` where no tile is cut by a shard boundary, else one per
    element ``[R, K]``. All-reduce MAX on the axes of the module docstring, counted under ``tag``;
    every rank of an axis calls it with the same shapes."""
    if granularity == "tensor":
        return all_max(compute_amax(x, "tensor"), rows.axes + cols.axes, tag)
    if granularity == "row":
        return all_max(compute_amax(x, "row"), cols.axes, tag)
    row_tile = TILE if granularity == "128x128" else 1
    cut = [(dim, tile) for dim, tile in ((rows, row_tile), (cols, TILE)) if tile > 1 and dim.cuts(tile)]
    if not cut:
        return compute_amax(x, granularity)
    # tiles of the global tensor: this rank's part of each, reduced over the ranks cutting them
    index = []
    for dim, tile, local in ((rows, row_tile, x.shape[0]), (cols, TILE, x.shape[1])):
        cutting = any(d is dim for d, _ in cut)
        ids = dim.ids(x.device) if cutting else torch.arange(local, device=x.device)
        index.append((ids // tile, -(-(dim.length if cutting else local) // tile)))
    (row_group, n_row), (col_group, n_col) = index
    group = (row_group[:, None] * n_col + col_group[None, :]).reshape(-1)
    values = torch.nan_to_num(x.detach().abs().float(), nan=float("inf")).reshape(-1)
    grid = torch.zeros(n_row * n_col, dtype=torch.float32, device=x.device)
    grid.scatter_reduce_(0, group, values, "amax")
    grid = all_max(grid, [axis for dim, _ in cut for axis in dim.axes], tag)
    return grid[group].reshape(x.shape)
