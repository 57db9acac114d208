"""How a parameter is split over the tensor-parallel axis, and its layout-independent initialisation.

Every ptdp parameter carries a :class:`GlobalParam` (attribute ``ptdp_global``) describing the
*global* (unsharded, vocab-padded) tensor and how tp ranks split it, so initialisation is the same
on every layout (:func:`init_shard`). :func:`unshard` rebuilds the global tensor from all shards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

INIT_KINDS = ("normal", "scaled_normal", "zeros", "ones")


@dataclass(frozen=True)
class GlobalParam:
    """Global shape and tensor-parallel split of one parameter.

    ``global_shape``: the unsharded shape (vocab rows padded); ``tp_dim``: the dim split over tp
    (None: replicated); ``tp_groups``: the split dim is viewed as ``[tp_groups, n]``, each group
    split separately (3: fused ``[q | k | v]``, 2: SwiGLU ``[gate | up]``); ``init``: "normal",
    "scaled_normal" (std / sqrt(2 * num_layers), GPT-2 / Megatron), "zeros" or "ones";
    ``real_rows``: real rows of dim 0, the rest zero padding.
    """

    global_shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_groups: int = 1
    init: str = "normal"
    real_rows: int | None = None

    def __post_init__(self) -> None:
        if self.init not in INIT_KINDS:
            raise ValueError(f"init={self.init!r} not in {INIT_KINDS}")

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of one tp rank's shard; raises ValueError if the split dim is not divisible."""
        shape = list(self.global_shape)
        if self.tp_dim is not None:
            if shape[self.tp_dim] % (tp_size * self.tp_groups) != 0:
                raise ValueError(
                    f"dim {self.tp_dim} of size {shape[self.tp_dim]} is not divisible by "
                    f"tp={tp_size} * groups={self.tp_groups}"
                )
            shape[self.tp_dim] //= tp_size
        return tuple(shape)


def make_parameter(spec: GlobalParam, tp_size: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter of the tp-local shape, tagged with ``spec``."""
    param = nn.Parameter(torch.empty(spec.local_shape(tp_size), dtype=dtype))
    param.ptdp_global = spec  # type: ignore[attr-defined]  # a dynamic attribute; read back by global_param
    return param


def global_param(param: torch.Tensor) -> GlobalParam:
    spec = getattr(param, "ptdp_global", None)
    if spec is None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no ptdp_global")
    return spec


def shard(full: torch.Tensor, spec: GlobalParam, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp_rank-th shard of the global tensor ``full`` (a contiguous copy)."""
    if spec.tp_dim is None or tp_size == 1:
        return full.clone()
    dim, groups = spec.tp_dim, spec.tp_groups
    n = full.shape[dim] // groups
    pieces = [part.chunk(tp_size, dim=dim)[tp_rank] for part in full.split(n, dim=dim)]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], spec: GlobalParam) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from the shards of tp ranks 0..tp-1."""
    if spec.tp_dim is None or len(shards) == 1:
        return shards[0].clone()
    dim, groups = spec.tp_dim, spec.tp_groups
    per_rank = [s.chunk(groups, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[g] for p in per_rank], dim=dim) for g in range(groups)], dim=dim)


INIT_BLOCK_ELEMENTS = 2**16
"""Elements of one independently drawn block of an initial weight (at least one index of its dim)."""


def init_block_size(spec: GlobalParam) -> int:
    """Indices of the block dim (the tp dim, else 0) per block: ``INIT_BLOCK_ELEMENTS`` divided
    by the product of the other dims, at least 1. It depends on those other dims only, never on
    the split dim's length (the padded vocabulary grows with tp)."""
    dim = _block_dim(spec)
    other = math.prod(n for d, n in enumerate(spec.global_shape) if d != dim)
    return max(1, INIT_BLOCK_ELEMENTS // max(other, 1))


def _block_dim(spec: GlobalParam) -> int:
    return spec.tp_dim if spec.tp_dim is not None else 0


def shard_ranges(spec: GlobalParam, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` index ranges of the split dim (dim 0 if replicated) that rank
    ``tp_rank``'s shard holds, in shard order: one per group of a fused split (:func:`shard`)."""
    length = spec.global_shape[_block_dim(spec)]
    if spec.tp_dim is None or tp_size == 1:
        return [(0, length)]
    n = length // spec.tp_groups
    per = n // tp_size
    return [(g * n + tp_rank * per, g * n + (tp_rank + 1) * per) for g in range(spec.tp_groups)]


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def _draw(spec: GlobalParam, name: str, seed: int, start: int, stop: int) -> torch.Tensor:
    """Standard normal values of indices ``[start, stop)`` of the block dim: every block they
    overlap is drawn whole (its full block shape, so its values do not depend on where it is
    cut) and the overlap kept."""
    dim, size = _block_dim(spec), init_block_size(spec)
    shape = list(spec.global_shape)
    shape[dim] = size
    parts = []
    for k in range(start // size, (stop - 1) // size + 1):
        block = torch.randn(shape, generator=torch.Generator().manual_seed(_block_seed(seed, name, k)))
        lo, hi = max(start, k * size), min(stop, (k + 1) * size)
        parts.append(block.narrow(dim, lo - k * size, hi - lo))
    return torch.cat(parts, dim) if len(parts) != 1 else parts[0]


def init_shard(
    spec: GlobalParam, *, name: str, seed: int, std: float, num_layers: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard (float32, ``spec.local_shape(tp_size)``) of parameter ``name``'s
    initial value, identical on every layout, drawing only the blocks the shard overlaps.

    Weights are N(0, std^2) (std / sqrt(2 * num_layers) for ``scaled_normal``, GPT-2 / Megatron).
    The global tensor is cut along its tp dim (dim 0 if replicated) into blocks of
    :func:`init_block_size` indices, block ``k`` seeded by a hash of ``(seed, name, k)``; a rank
    draws the blocks its ranges (:func:`shard_ranges`) overlap. Padded rows are zero.
    """
    local = spec.local_shape(tp_size)
    if spec.init == "zeros":
        return torch.zeros(local)
    if spec.init == "ones":
        return torch.ones(local)
    if spec.init == "scaled_normal":
        std = std / math.sqrt(2.0 * num_layers)
    ranges = shard_ranges(spec, tp_rank, tp_size)
    dim = _block_dim(spec)
    out = torch.cat([_draw(spec, name, seed, a, b) for a, b in ranges], dim).mul_(std)
    if spec.real_rows is not None:
        rows = torch.cat([torch.arange(a, b) for a, b in ranges]) if dim == 0 else torch.arange(local[0])
        out[rows >= spec.real_rows] = 0.0
    return out


def init_full(spec: GlobalParam, *, name: str, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The global initial value of parameter ``name`` (float32): :func:`init_shard` at tp = 1,
    which every layout's shards are slices of."""
    return init_shard(spec, name=name, seed=seed, std=std, num_layers=num_layers, tp_rank=0, tp_size=1)


@torch.no_grad()
def initialize_parameters(
    module: nn.Module, *, seed: int, std: float, num_layers: int, tp_rank: int, tp_size: int
) -> None:
    """Fill every parameter of ``module`` with its shard of the layout-independent initial value
    (:func:`init_shard`: each rank draws only what its shard overlaps). A parameter split otherwise
    (the stacked experts of an MoE layer) carries its own ``ptdp_init(name=, seed=, std=,
    num_layers=)``."""
    for name, param in module.named_parameters():
        own = getattr(param, "ptdp_init", None)
        if own is not None:
            param.copy_(own(name=name, seed=seed, std=std, num_layers=num_layers))
            continue
        spec = global_param(param)
        param.copy_(
            init_shard(spec, name=name, seed=seed, std=std, num_layers=num_layers, tp_rank=tp_rank, tp_size=tp_size)
        )
