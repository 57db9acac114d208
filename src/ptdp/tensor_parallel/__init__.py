"""Tensor parallelism: f/g operators, column/row-parallel linears, vocab-parallel embedding and loss."""

from ptdp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ptdp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ptdp.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from ptdp.tensor_parallel.sharding import ParamSpec, initialize_parameters, shard, spec_of, unshard

__all__ = [
    "ColumnParallelLinear",
    "ParamSpec",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "initialize_parameters",
    "reduce_from_tp",
    "shard",
    "spec_of",
    "unshard",
    "vocab_parallel_cross_entropy",
]
