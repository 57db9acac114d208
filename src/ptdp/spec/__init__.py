"""The spec layer: what a run is (the configuration schema, its command-line flags and config
files), the rules it must satisfy, and the rank layout. Pure: imports no torch, so the planner and
every command's validation use it before any process or process group exists.

Import from here: ``from ptdp.spec import Config, ModelConfig, resolve, ConfigError``.
"""

from ptdp.engine.pipeline.partition import (
    accounted_split,
    chunk_layer_counts,
    chunk_layer_ids,
    first_last_of,
    first_last_split,
    layer_split,
    stage_layer_counts,
    virtual_stages,
)
from ptdp.engine.tensor_parallel.vocab import keeps_logits, padded_vocab_size
from ptdp.spec.axis_rules import context_parallel_violations, sequence_parallel_violations
from ptdp.spec.config import SECTIONS, CheckpointConfig, Config, DataConfig, LaunchConfig, TrainConfig
from ptdp.spec.errors import ConfigError, Violation
from ptdp.spec.fields import (
    ACTIVATIONS,
    BIND_POLICIES,
    DTYPES,
    GRAD_COMPRESSIONS,
    MIN_VOCAB_SIZE,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    SCHEDULES,
    SHARDING_STRATEGIES,
)
from ptdp.spec.model import ModelConfig
from ptdp.spec.parallel import ParallelConfig
from ptdp.spec.resolve import DEFAULT_LOCAL_WORKERS, local_world_size, resolve
from ptdp.spec.rules import heads_violations, layout_violations, recompute_violations, schedule_violations

__all__ = [
    "ACTIVATIONS",
    "BIND_POLICIES",
    "DEFAULT_LOCAL_WORKERS",
    "DTYPES",
    "GRAD_COMPRESSIONS",
    "MIN_VOCAB_SIZE",
    "NORMALIZATIONS",
    "POSITION_EMBEDDINGS",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "SCHEDULES",
    "SECTIONS",
    "SHARDING_STRATEGIES",
    "context_parallel_violations",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "Violation",
    "chunk_layer_counts",
    "heads_violations",
    "keeps_logits",
    "layout_violations",
    "local_world_size",
    "padded_vocab_size",
    "recompute_violations",
    "resolve",
    "schedule_violations",
    "sequence_parallel_violations",
    "stage_layer_counts",
    "accounted_split",
    "chunk_layer_ids",
    "first_last_of",
    "first_last_split",
    "layer_split",
    "virtual_stages",
]
