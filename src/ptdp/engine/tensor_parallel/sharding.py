"""How a parameter is split over the tensor-parallel axis, and its layout-independent initialisation.

Every ptdp parameter carries a :class:`ParamSpec` (attribute ``ptdp_spec``) describing the *global*
(unsharded, vocab-padded) tensor and how tp ranks split it. That makes initialisation independent of
the layout: each rank draws the full tensor from a generator seeded by the parameter's name and keeps
its own shard, so tp=1 and tp=4 start from identical weights. :func:`unshard` rebuilds the global
tensor from all shards (used by tests and, later, checkpoint export).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

INIT_KINDS = ("normal", "scaled_normal", "zeros", "ones")


@dataclass(frozen=True)
class ParamSpec:
    """Global shape and tensor-parallel split of one parameter.

    Attributes:
        global_shape: shape of the whole, unsharded tensor (vocab rows already padded).
        tp_dim: tensor dim split over tp ranks; None means replicated on every tp rank.
        tp_groups: the split dim is viewed as [tp_groups, n] and each group is split separately
            (3 for a fused QKV projection laid out [q | k | v], so every rank gets its heads' q, k, v;
            2 for a SwiGLU fc1 laid out [gate | up], so every rank gets matching gate and up rows).
        init: "normal" (std), "scaled_normal" (std / sqrt(2 * num_layers), for the projections
            into the residual stream, GPT-2 / Megatron), "zeros" or "ones".
        real_rows: rows of dim 0 that are real (vocabulary); rows past it are padding, kept at zero.
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


def make_parameter(spec: ParamSpec, tp_size: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter of the tp-local shape, tagged with ``spec``."""
    param = nn.Parameter(torch.empty(spec.local_shape(tp_size), dtype=dtype))
    param.ptdp_spec = spec
    return param


def spec_of(param: torch.Tensor) -> ParamSpec:
    spec = getattr(param, "ptdp_spec", None)
    if spec is None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no ptdp_spec")
    return spec


def shard(full: torch.Tensor, spec: ParamSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp_rank-th shard of the global tensor ``full`` (a contiguous copy)."""
    if spec.tp_dim is None or tp_size == 1:
        return full.clone()
    dim, groups = spec.tp_dim, spec.tp_groups
    n = full.shape[dim] // groups
    pieces = [
        part.chunk(tp_size, dim=dim)[tp_rank] for part in full.split(n, dim=dim)
    ]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from the shards of tp ranks 0..tp-1."""
    if spec.tp_dim is None or len(shards) == 1:
        return shards[0].clone()
    dim, groups = spec.tp_dim, spec.tp_groups
    per_rank = [s.chunk(groups, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[g] for p in per_rank], dim=dim) for g in range(groups)], dim=dim)


def init_full(spec: ParamSpec, *, name: str, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The global initial value of parameter ``name`` (float32), identical on every layout.

    Weights are drawn from N(0, std^2) (N(0, (std / sqrt(2 * num_layers))^2) for ``scaled_normal``,
    GPT-2 / Megatron) with a generator seeded by ``seed`` and a CRC32 of ``name``; padded vocab
    rows are zero.
    """
    if spec.init == "zeros":
        return torch.zeros(spec.global_shape)
    if spec.init == "ones":
        return torch.ones(spec.global_shape)
    if spec.init == "scaled_normal":
        std = std / math.sqrt(2.0 * num_layers)
    real = list(spec.global_shape)
    if spec.real_rows is not None:
        real[0] = spec.real_rows
    gen = torch.Generator().manual_seed((seed * 2654435761 + zlib.crc32(name.encode())) % 2**63)
    full = torch.zeros(spec.global_shape)
    full[tuple(slice(0, n) for n in real)] = torch.randn(real, generator=gen) * std
    return full


@torch.no_grad()
def initialize_parameters(
    module: nn.Module, *, seed: int, std: float, num_layers: int, tp_rank: int, tp_size: int
) -> None:
    """Fill every parameter of ``module`` with its shard of the layout-independent initial value."""
    for name, param in module.named_parameters():
        spec = spec_of(param)
        full = init_full(spec, name=name, seed=seed, std=std, num_layers=num_layers)
        param.copy_(shard(full, spec, tp_rank, tp_size))
