"""What one of ``cp`` context-parallel ranks holds: cp rank ``i`` keeps chunks ``i`` and ``2 cp - 1 -
i`` of ``2 cp`` (causal load balance), ``s / cp`` tokens, so everything per token is that of a
sequence of ``s / cp`` tokens (:func:`local_model`), while its queries attend keys of the whole
sequence. Parameters are replicated over cp; sharded state splits over ``dp x cp``. The key/value
exchange buffers: p2p ``8 B e`` bytes (K, V, dK, dV, two blocks each), all_gather ``4 cp B e``.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ptdp.config.model import ModelConfig


@lru_cache(maxsize=4096)
def local_model(model: ModelConfig, cp: int) -> ModelConfig:
    """``model`` seen by one cp rank for everything per token: ``seq_length = s / cp`` (exact: the
    rule ``s % (2 cp) == 0`` holds). ``cp = 1`` returns ``model``. Not for parameter counts (a
    learned position table is ``[s, h]`` on every rank)."""
    if cp == 1:
        return model
    return dataclasses.replace(model, seq_length=model.seq_length // cp)


def kv_block_elements(model: ModelConfig, tp: int, cp: int, micro_batch_size: int) -> float:
    """Elements of one key (or value) block on one tp rank: ``(s / cp) b kv d / t``, ``kv`` the heads
    the attention kernel receives (:attr:`~ptdp.config.model.ModelConfig.attended_kv_heads`)."""
    d = model.head_dim
    return model.seq_length / cp * micro_batch_size * model.attended_kv_heads * d / tp


def kv_buffer_bytes(
    model: ModelConfig, tp: int, cp: int, micro_batch_size: int, comm_type: str, bytes_per_value: float = 2.0
) -> float:
    """Peak bytes of the key/value exchange of the one layer running (transient; once per stage):
    p2p ``8 B e`` (K, V, dK, dV, two blocks each), all_gather ``4 cp B e``; 0 when cp = 1."""
    if cp <= 1:
        return 0.0
    block = kv_block_elements(model, tp, cp, micro_batch_size) * bytes_per_value
    if comm_type == "p2p":
        return 8.0 * block
    if comm_type == "all_gather":
        return 4.0 * cp * block
    raise ValueError(f"cp_comm_type={comm_type!r} must be p2p or all_gather")


def unfused_score_bytes_missing(local_none: float, local_selective: float, cp: int, flash: bool) -> float:
    """What :func:`ptdp.planner.memory.activations.layer_activation_bytes` of :func:`local_model` leaves out
    without a fused kernel: the kept scores are ``(s/cp) x s`` per head, the local model counts
    ``(s/cp) x (s/cp)``; the score part (no recompute minus selective) times ``cp - 1``. A fused
    kernel keeps a per-query log-sum-exp only, already right."""
    if cp <= 1 or flash:
        return 0.0
    return (cp - 1) * (local_none - local_selective)
