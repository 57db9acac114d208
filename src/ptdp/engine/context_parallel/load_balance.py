"""The load-balanced sequence layout of context parallelism (pure index arithmetic on tensors).

A sequence of ``s`` tokens is cut into ``2C`` chunks of ``c = s / (2C)`` (``C`` the cp size); cp
rank ``r`` holds chunk ``r`` then chunk ``2C - 1 - r``, so under a causal mask every rank does
``(r + 1) + (2C - r) = 2C + 1`` chunk-pairs of work. Source: Dubey et al. 2024, "The Llama 3 Herd
of Models", §3.3.2; Megatron-Core's context-parallel documentation (the same split).

Example, ``s = 8``, ``C = 2`` (chunks of 2 tokens): rank 0 holds positions 0 1 6 7, rank 1 holds
2 3 4 5. Positions increase along the local sequence, so a causal mask on local indices is the
causal mask on global positions (:mod:`.cp_attention`).
"""

from __future__ import annotations

import torch


def check_sequence(seq_length: int, cp_size: int) -> int:
    """The chunk length ``seq_length / (2 * cp_size)`` (with ``cp_size == 1`` any positive length
    is accepted, as the configuration rule does, and the result is ``seq_length // 2``).

    Raises:
        ValueError: ``cp_size < 1``, or ``seq_length`` not positive or, with ``cp_size > 1``, not
            a multiple of ``2 * cp_size`` (the message names both numbers and the rule).
    """
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be >= 1, got cp_size={cp_size}")
    if seq_length <= 0 or (cp_size > 1 and seq_length % (2 * cp_size)):
        raise ValueError(
            f"sequence length {seq_length} is not a positive multiple of 2 * cp_size = "
            f"2 * {cp_size} = {2 * cp_size} (each cp rank holds 2 equal chunks of the sequence)"
        )
    return seq_length // (2 * cp_size)


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks of the sequence held by ``cp_rank``, in local order: ``(r, 2C - 1 - r)``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, cp_size = {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int, *, device=None) -> torch.Tensor:
    """Global positions of this rank's ``s / C`` tokens, in local order (int64 ``[s / C]``): what
    rotary or learned position embeddings must be evaluated at."""
    c = check_sequence(seq_length, cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    local = torch.arange(2 * c, device=device)
    return torch.where(local < c, first * c + local, second * c + local - c)


def rank_positions(
    seq_length: int, cp_rank: int, cp_size: int, *, tp_rank: int = 0, tp_size: int = 1, device=None
) -> torch.Tensor:
    """Global positions of the hidden-state rows a rank holds outside attention and the MLP
    (int64 ``[s / (C t)]``): its cp chunks' positions (:func:`local_positions`), and with sequence
    parallelism over ``tp_size`` ranks the ``tp_rank``-th contiguous block of them (the rows of
    ``[s/(C t), b, h]``; ``tp_size=1`` without sequence parallelism).

    Raises:
        ValueError: as :func:`check_sequence`, or ``s / C`` not divisible by ``tp_size``.
    """
    local = local_positions(seq_length, cp_rank, cp_size, device=device)
    if local.numel() % tp_size or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"the {local.numel()} positions of a cp rank (seq_length {seq_length} / cp {cp_size}) cannot "
            f"be split over {tp_size} tp ranks (rule: seq_length % (cp * tp) == 0 with sequence "
            f"parallelism), or tp_rank {tp_rank} is outside [0, {tp_size})"
        )
    per = local.numel() // tp_size
    return local[tp_rank * per : (tp_rank + 1) * per]


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int) -> torch.Tensor:
    """This rank's part of ``x`` along tensor dim ``dim`` (the sequence: dim 1 of ``[b, s]`` or
    ``[b, heads, s, d]``, dim 0 of ``[s, b, ...]``): chunks ``r`` and ``2C - 1 - r`` concatenated,
    ``s / C`` long (a new tensor; ``x`` itself when ``cp_size == 1``).

    Raises:
        ValueError: ``cp_size > 1`` and the length of dim ``dim`` is not a multiple of ``2 * cp_size``.
    """
    if cp_size == 1:
        return x
    c = check_sequence(x.shape[dim], cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], *, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from cp rank ``r``, each ``s / C``
    long along ``dim``): the inverse of :func:`shard_sequence`, done locally."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    n = parts[0].shape[dim]
    if n % 2 or any(p.shape[dim] != n for p in parts):
        raise ValueError(
            f"every part must have the same even length along dim {dim}, got {[p.shape[dim] for p in parts]}"
        )
    c = n // 2
    chunks = [p.narrow(dim, 0, c) for p in parts] + [p.narrow(dim, c, c) for p in reversed(parts)]
    return torch.cat(chunks, dim=dim)
