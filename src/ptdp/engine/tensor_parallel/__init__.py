"""Tensor parallelism: f/g operators, column/row-parallel linears, vocab-parallel embedding and loss,
and the sequence-parallel operators.

Names are imported on first use (PEP 562), so the pure arithmetic of :mod:`.vocab` can be used
(by the configuration rules and the planner) without importing torch.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "vocab_parallel_cross_entropy": "cross_entropy",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "copy_to_tp": "mappings",
    "reduce_from_tp": "mappings",
    "all_gather_sequence": "sequence",
    "is_sequence_parallel": "sequence",
    "mark_sequence_parallel": "sequence",
    "reduce_scatter_sequence": "sequence",
    "sequence_gathered_linear": "sequence",
    "sequence_shard": "sequence",
    "ParamSpec": "sharding",
    "initialize_parameters": "sharding",
    "shard": "sharding",
    "spec_of": "sharding",
    "unshard": "sharding",
    "padded_vocab_size": "vocab",
}

__all__ = sorted(_WHERE)  # noqa: PLE0605 - the lazily imported names, listed once in _WHERE


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ptdp.engine.tensor_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ptdp.engine.tensor_parallel.{_WHERE[name]}"), name)
