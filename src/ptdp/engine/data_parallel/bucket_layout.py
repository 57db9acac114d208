"""The buckets of a :class:`~ptdp.engine.data_parallel.buffer.GradBuffer`: which parameters are
reduced together, where they sit in the flat layout, and which part of them a rank's shard holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.layout.buckets import chunk_buckets


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
    """The :class:`Bucket` of each chunk's parameters as :func:`ptdp.layout.buckets.chunk_buckets`
    cuts them (``deferred``: parameter ids, each alone in a bucket that never starts early;
    ``unit_of``: parameter id -> ZeRO-3 unit), laid out one after another, each padded to a
    multiple of ``multiple``."""
    buckets: list[Bucket] = []
    start = 0
    for chunk, params in enumerate(chunk_params):
        alone = {i for i, p in enumerate(params) if id(p) in deferred}
        units = [unit_of.get(id(p)) for p in params] if unit_of else None
        for members in chunk_buckets([p.numel() for p in params], bucket_size, units=units, deferred=alone):
            numel = sum(params[i].numel() for i in members)
            numel += (-numel) % multiple
            early = not (len(members) == 1 and members[0] in alone)
            buckets.append(Bucket(len(buckets), chunk, [params[i] for i in members], start, numel, overlap and early))
            start += numel
    return buckets
