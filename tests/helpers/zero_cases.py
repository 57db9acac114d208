"""The sharded data-parallel cases (``--data-parallel-sharding-strategy``): the tiny float64 GPT
trained 3 steps at a (tp, pp, dp) layout, every layout of one world size in one job, against the
same model in one process without sharding."""

from __future__ import annotations

import dataclasses
import functools

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import tiny_config, train_and_collect
from ptdp.engine.groups import ParallelGroups
from ptdp.spec import Config
from ptdp.spec.layout import ParallelLayout

#: (tp, pp, dp) by world size: one job per world size
LAYOUTS = {4: [(1, 1, 4), (2, 1, 2), (1, 2, 2)], 8: [(2, 2, 2)]}

#: name -> (dtype, model overrides, parallel overrides, train overrides). Every case accumulates
#: 2 (dp = 4) or 4 (dp = 2) microbatches of 1 sequence per step, clipping at 0.05 fires.
VARIANTS = {
    # buckets of 901 elements: padded to a multiple of dp, several per stage, reduced when each
    # backward ends
    "grads": ("float64", {}, {"ddp_bucket_size": 901}, {}),
    # buckets reduced during every backward, parameters gathered by the next forward's pre-hooks
    "grads_overlap": ("float64", {}, {"ddp_bucket_size": 1500, "overlap_grad_reduce": True,
                                      "overlap_param_gather": True}, {}),
    # an untied output layer, one bucket per stage (the default size)
    "grads_untied": ("float64", {"untie_embeddings_and_output_weights": True}, {}, {}),
    # interleaved 1F1B: 8 layers in 2 chunks per pipeline rank
    "grads_interleaved": ("float64", {"num_layers": 8}, {"pipeline_schedule": "interleaved-1f1b",
                                                         "num_layers_per_virtual_pipeline_stage": 2,
                                                         "ddp_bucket_size": 901}, {}),
    # bf16 weights: float32 main gradients written by the layers (main_grad), float32 shards
    "grads_bf16": ("bfloat16", {}, {"ddp_bucket_size": 901, "overlap_grad_reduce": True}, {}),
}


def variants(tp: int, pp: int, dp: int) -> list[str]:
    """Every layout runs the GPT with and without overlap and bf16; the untied output layer at
    pp = 2 (dp = 2); the interleaved schedule where pp = 2."""
    names = ["grads", "grads_overlap", "grads_bf16"]
    if pp == 2:
        names += ["grads_untied", "grads_interleaved"]
    return names


def zero_config(name: str, tp: int, pp: int, dp: int, strategy: str = "optim_grads") -> Config:
    """Variant ``name`` at this layout with ``strategy``; at tp = pp = dp = 1 (the reference) the
    same model in one process with no sharding and no pipeline options."""
    dtype, model, parallel, train = VARIANTS[name]
    parallel = dict(parallel)
    if pp == 1:
        parallel.pop("pipeline_schedule", None)
        parallel.pop("num_layers_per_virtual_pipeline_stage", None)
    if tp * pp * dp == 1:
        parallel, strategy = {}, "no_shard"
    parallel["data_parallel_sharding_strategy"] = strategy
    train = {"micro_batch_size": 1} | train
    return tiny_config(tp, pp, dp, dtype, train_overrides=train, parallel_overrides=parallel, **model)


def zero_worker(rank: int, world: int) -> dict:
    """Every layout of this world size, each of its variants in turn: ``{layout: {variant: result}}``
    (the first variant's communication of step 0 recorded)."""
    out = {}
    for tp, pp, dp in LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
        out[(tp, pp, dp)] = {name: train_and_collect(zero_config(name, tp, pp, dp), groups, 0)
                             for name in variants(tp, pp, dp)}
    return out


@functools.cache
def world_results(world: int) -> list[dict]:
    """Every rank's results of the layouts of ``world`` (one job on the session's workers; cached)."""
    return run_in_pool(zero_worker, world)


@functools.cache
def reference(name: str) -> dict:
    """The single-process, unsharded run of variant ``name``."""
    return train_and_collect(zero_config(name, 1, 1, 1), ParallelGroups.single_process())


def with_strategy(cfg: Config, strategy: str) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_sharding_strategy=strategy))
