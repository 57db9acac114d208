"""Tensor parallelism: f/g operators, column/row-parallel linears, vocab-parallel embedding and loss,
and the sequence-parallel operators."""

from ptdp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ptdp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ptdp.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from ptdp.tensor_parallel.sequence import (all_gather_sequence, is_sequence_parallel, mark_sequence_parallel,
                                           reduce_scatter_sequence, sequence_gathered_linear, sequence_shard)
from ptdp.tensor_parallel.sharding import ParamSpec, initialize_parameters, shard, spec_of, unshard

__all__ = [
    "ColumnParallelLinear",
    "ParamSpec",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_sequence",
    "copy_to_tp",
    "initialize_parameters",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "sequence_gathered_linear",
    "sequence_shard",
    "shard",
    "spec_of",
    "unshard",
    "vocab_parallel_cross_entropy",
]
