"""The memory check before start counts each data-parallel sharding strategy as the planner does:
parameters, gradients and optimizer state per rank from ``rank_state_bytes`` (transients
included), so optim_grads and optim_grads_params are not counted as ZeRO-1; it suggests
optim_grads_params when that lowers the estimate."""

from __future__ import annotations

import dataclasses

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.planner.candidate import run_candidate
from ptdp.planner.memory.params import rank_state_bytes, stage_param_counts
from ptdp.run.memory_check import GiB, memory_problem, needed_bytes, rank_estimates

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _config(strategy: str, dtype: str = "bfloat16") -> Config:
    model = ModelConfig(
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=8,
        seq_length=256,
        vocab_size=8000,  # a layer (12.6 M parameters) is the largest unit
        params_dtype=dtype,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        data_parallel_size=4,
        data_parallel_sharding_strategy=strategy,
        # buckets of 2 M elements (a sixth of a layer): with the default 40 M, three buckets
        # (two in flight, one filling) hold more than the stage's unsharded gradient
        ddp_bucket_size=2_000_000,
    )
    train = TrainConfig(micro_batch_size=1, global_batch_size=16)
    return resolve(Config(model=model, parallel=parallel, train=train), 8)


def test_each_strategy_is_counted_as_the_planner_counts_it():
    estimates = {s: rank_estimates(_config(s)) for s in STRATEGIES}
    for strategy, ranks in estimates.items():
        config = _config(strategy)
        model, p = config.model, config.parallel
        counts = stage_param_counts(model, p.tp, p.pp, make_vocab_size_divisible_by=128)
        layout = run_candidate(config)
        for stage, (r, n) in enumerate(zip(ranks, counts)):
            assert (r.params, r.grads, r.optimizer) == rank_state_bytes(model, layout, n, 8, stage=stage), strategy
    stage0 = {s: ranks[0] for s, ranks in estimates.items()}
    assert stage0["optim"].optimizer < stage0["no_shard"].optimizer
    assert stage0["optim_grads"].grads < stage0["optim"].grads == stage0["no_shard"].grads
    assert stage0["optim_grads_params"].params < stage0["optim_grads"].params == stage0["no_shard"].params
    # optim_grads_params: a quarter of the float32 weights (the main copy) plus two gathered bf16
    # units, fp32 gradients a quarter, Adam's moments a quarter
    n = stage_param_counts(_config("no_shard").model, 1, 2, make_vocab_size_divisible_by=128)[0]
    assert stage0["optim_grads_params"].params > 4 * n / 4
    assert stage0["optim_grads_params"].optimizer == 8 * n / 4


def test_optim_grads_params_is_suggested_when_it_helps():
    config = _config("no_shard")
    need = needed_bytes(config, 8, gpu=True)
    text = memory_problem(config, 8, need - 1, gpu=True, where="each GPU")
    zero3 = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, data_parallel_sharding_strategy="optim_grads_params")
    )
    assert (
        f"--data-parallel-sharding-strategy optim_grads_params ({needed_bytes(zero3, 8, gpu=True) / GiB:,.1f} GiB)"
        in text
    )
    already = _config("optim_grads_params")
    text = memory_problem(already, 8, needed_bytes(already, 8, gpu=True) - 1, gpu=True, where="each GPU")
    assert "--data-parallel-sharding-strategy optim_grads_params (" not in text


def test_a_smaller_bucket_is_suggested_when_buckets_exceed_a_layer():
    """optim_grads with the default 40 M-element buckets on layers of 12.6 M parameters: a backward
    holds buckets worth more than the stage's unsharded gradient; an eighth of a layer is
    suggested, with its (lower) estimate."""
    config = dataclasses.replace(
        _config("optim_grads"), parallel=dataclasses.replace(_config("optim_grads").parallel, ddp_bucket_size=None)
    )
    assert rank_estimates(config)[0].grads > rank_estimates(_config("optim"))[0].grads
    need = needed_bytes(config, 8, gpu=True)
    text = memory_problem(config, 8, need - 1, gpu=True, where="each GPU")
    smaller = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, ddp_bucket_size=1_574_528))
    assert needed_bytes(smaller, 8, gpu=True) < need
    assert f"--ddp-bucket-size 1574528 ({needed_bytes(smaller, 8, gpu=True) / GiB:,.1f} GiB)" in text
