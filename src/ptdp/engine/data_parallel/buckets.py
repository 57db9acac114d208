"""The buckets of a :class:`~ptdp.engine.data_parallel.buffer.GradBuffer`: which parameters are
reduced together, where they sit in the flat layout, and which part of them a rank's shard holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together; ``[start, start + numel)`` of the buffer."""

    index: int
    chunk: int
    params: list[nn.Parameter]
    start: int
    numel: int
    overlap: bool
    ready: set[int] = field(default_factory=set)
    finish: Callable[[], None] | None = None
    blocks: torch.Tensor | None = None
    """1-bit scale block sizes (:func:`~ptdp.engine.data_parallel.compression.block_sizes`), 1bit only."""
    data: torch.Tensor | None = None
    """``shard_grads`` only: the bucket's own ``[numel]`` gradient tensor (its storage released
    between uses); otherwise the bucket is ``[start, start + numel)`` of the flat buffer."""

    def own_data(self) -> torch.Tensor:
        """:attr:`data`, which a ``shard_grads`` buffer gives every bucket (ValueError otherwise)."""
        if self.data is None:
            raise ValueError(f"bucket {self.index} has no gradient tensor of its own (shard_grads only)")
        return self.data

    def wait(self) -> None:
        """Finish the bucket's started reduction (RuntimeError if none was started)."""
        if self.finish is None:
            raise RuntimeError(f"bucket {self.index}: no reduction was started")
        self.finish()


@dataclass(frozen=True)
class Segment:
    """The part ``[lo, hi)`` of a parameter (flattened) that falls in this rank's shard, at
    ``shard_offset`` of :attr:`GradBuffer.shard_grads`."""

    param: nn.Parameter
    lo: int
    hi: int
    shard_offset: int


def plan_buckets(
    chunk_params: list[list[nn.Parameter]],
    bucket_size: int,
    overlap: bool,
    deferred: set[int],
    multiple: int,
    unit_of: dict[int, int] | None = None,
) -> list[Bucket]:
    """Cut each chunk's parameters, back to front (the order backward produces their gradients),
    into buckets of at most ``bucket_size`` elements (a larger parameter gets one of its own),
    each padded to a multiple of ``multiple``; every ``deferred`` parameter alone in a bucket that
    never starts early. ``unit_of`` (parameter id -> unit index, ``optim_grads_params``): a bucket
    never holds parameters of two units, so a unit's all-gather is that of whole buckets."""
    unit_of = unit_of or {}
    buckets: list[Bucket] = []
    start = 0

    def close(chunk: int, params: list[nn.Parameter], can_overlap: bool) -> None:
        nonlocal start
        numel = sum(p.numel() for p in params)
        numel += (-numel) % multiple
        buckets.append(Bucket(len(buckets), chunk, params, start, numel, overlap and can_overlap))
        start += numel

    for chunk, params in enumerate(chunk_params):
        current: list[nn.Parameter] = []
        for p in reversed(params):
            if id(p) in deferred:
                close(chunk, [p], False)
                continue
            other_unit = bool(current) and unit_of.get(id(current[-1])) != unit_of.get(id(p))
            if current and (other_unit or sum(q.numel() for q in current) + p.numel() > bucket_size):
                close(chunk, current, True)
                current = []
            current.append(p)
        if current:
            close(chunk, current, True)
    return buckets
