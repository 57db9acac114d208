"""Context parallelism: the sequence split over the ranks of the ``cp`` axis.

The pieces the model (:mod:`ptdp.engine.model.gpt`) uses when cp > 1: the load-balanced layout
of the sequence and the positions a rank holds (:mod:`.chunks`), causal attention block by block
merged by log-sum-exp (:mod:`.blockwise`), and attention across the cp ranks with an all-gather
or a ring of point-to-point transfers of keys and values (:mod:`.attention`, :mod:`.ring`), each
block computed by the explicit kernel or a fused flash-attention one (:mod:`.kernels`).

Names are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib

_WHERE = {
    "check_sequence": "chunks",
    "chunk_ids": "chunks",
    "local_positions": "chunks",
    "rank_positions": "chunks",
    "shard_sequence": "chunks",
    "unshard_sequence": "chunks",
    "Partial": "blockwise",
    "attention_block": "blockwise",
    "attention_block_backward": "blockwise",
    "block_attention": "blockwise",
    "block_kind": "blockwise",
    "blockwise_causal_attention": "blockwise",
    "merge": "blockwise",
    "context_parallel_attention": "attention",
    "cp_attention_comm": "attention",
}

__all__ = sorted(_WHERE)  # noqa: PLE0605 - the lazily imported names, listed once in _WHERE


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ptdp.engine.context_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ptdp.engine.context_parallel.{_WHERE[name]}"), name)
