"""Context parallelism and data-parallel sharding strategies in the configuration schema: one flag
each, shared by ``ptdp train`` and ``ptdp plan``; ``ptdp train`` rejects what it cannot run
(optim_grads_params with the distributed optimizer's overlapped all-gather, --no-reshard-after-forward
without optim_grads_params, 1-bit codecs with sharding) and a sequence that 2 cp chunks do not
divide before any process, with exit code 2; cp > 1 resolves (dp from the world divided by tp cp
pp), optim_grads and optim_grads_params resolve as sharded optimizers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ptdp import cli
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.rules.axes import context_parallel_violations
from ptdp.config.schema import Config, TrainConfig
from ptdp.config.train_flags import add_train_arguments
from ptdp.errors import ConfigError
from ptdp.planner.inputs.plan_flags import add_plan_arguments


def _config(**parallel) -> Config:
    return Config(model=ModelConfig(seq_length=64), parallel=ParallelConfig(**parallel), train=TrainConfig())


def test_flags_and_aliases_are_shared_by_train_and_plan():
    train, plan = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_train_arguments(train, local_launch=True)
    add_plan_arguments(plan)
    for parser, default in ((train, 1), (plan, None)):
        assert parser.parse_args([]).context_parallel_size == default
        assert parser.parse_args(["--cp", "4"]).context_parallel_size == 4
        assert parser.parse_args(["--context-parallel-size", "2"]).context_parallel_size == 2
        assert parser.parse_args([]).data_parallel_sharding_strategy is None
        args = parser.parse_args(["--data-parallel-sharding-strategy", "optim_grads"])
        assert args.data_parallel_sharding_strategy == "optim_grads"


def test_world_is_tp_cp_pp_dp_and_the_sequence_splits_into_2cp_chunks():
    assert context_parallel_violations(64, 1) == [] and context_parallel_violations(64, 32) == []
    (v,) = context_parallel_violations(96, 32)
    assert "seq_length=96 is not divisible by 2*context_parallel_size = 2*32 = 64" in v.message
    assert "positive integer" in context_parallel_violations(64, 0)[0].message
    with pytest.raises(
        ConfigError,
        match=r"world_size=8 != tp\*cp\*pp\*dp = 2\*2\*2\*2 = 16 \(rule: world_size = "
        r"tp \* cp \* pp \* dp\)",
    ):
        resolve(
            _config(
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                context_parallel_size=2,
                data_parallel_size=2,
            ),
            8,
        )


def test_cp_resolves_with_dp_from_the_world():
    p = resolve(
        _config(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=1,
            context_parallel_size=2,
            use_distributed_optimizer=True,
        ),
        8,
    ).parallel
    assert (p.tp, p.cp, p.pp, p.dp, p.sharding_strategy) == (2, 2, 1, 2, "optim")


@pytest.mark.parametrize(
    "parallel, message",
    [
        (
            dict(data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True),
            "overlap_param_gather does not apply to data_parallel_sharding_strategy=optim_grads_params",
        ),
        (
            dict(data_parallel_sharding_strategy="optim_grads", reshard_after_forward=False),
            r"reshard_after_forward=False \(--no-reshard-after-forward\) needs "
            r"data_parallel_sharding_strategy=optim_grads_params, not optim_grads",
        ),
        (
            dict(data_parallel_sharding_strategy="optim_grads_params", grad_compression="1bit"),
            r"grad_compression=1bit cannot be combined with a sharded data-parallel state \(data_parallel_sharding_strategy=optim_grads_params;",
        ),
        (dict(data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=True), "contradicts"),
        (
            dict(data_parallel_sharding_strategy="optim_grads", grad_compression="1bit"),
            r"grad_compression=1bit cannot be combined .*data_parallel_sharding_strategy=optim_grads.*reduce-scattered",
        ),
    ],
)
def test_train_rejects_what_it_cannot_run(parallel, message):
    with pytest.raises(ConfigError, match=message):
        resolve(_config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, **parallel), 2)


def test_optim_grads_resolves_as_a_sharded_optimizer():
    p = resolve(
        _config(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            overlap_param_gather=True,
            data_parallel_sharding_strategy="optim_grads",
        ),
        2,
    ).parallel
    assert p.use_distributed_optimizer and p.sharding_strategy == "optim_grads"


def test_optim_grads_params_resolves_with_or_without_resharding():
    for reshard in (True, False):
        p = resolve(
            _config(
                tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1,
                data_parallel_sharding_strategy="optim_grads_params",
                reshard_after_forward=reshard,
            ),
            2,
        ).parallel
        assert p.use_distributed_optimizer and p.sharding_strategy == "optim_grads_params"
        assert p.reshard_after_forward is reshard


def test_optim_is_the_distributed_optimizer():
    for given in (dict(data_parallel_sharding_strategy="optim"), dict(use_distributed_optimizer=True)):
        p = resolve(
            _config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, overlap_param_gather=True, **given), 2
        ).parallel
        assert p.use_distributed_optimizer and p.sharding_strategy == "optim"
    p = resolve(_config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1), 2).parallel
    assert not p.use_distributed_optimizer and p.sharding_strategy == "no_shard"
    # a resolved config keeps the strategy unset, so a replay can still add --use-distributed-optimizer
    assert p.data_parallel_sharding_strategy is None
    again = dataclasses.replace(
        _config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
        parallel=dataclasses.replace(p, use_distributed_optimizer=True),
    )
    assert resolve(again, 2).parallel.sharding_strategy == "optim"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--data-parallel-sharding-strategy", "optim", "--no-reshard-after-forward"],
            "reshard_after_forward=False (--no-reshard-after-forward) needs data_parallel_sharding_strategy="
            "optim_grads_params, not optim",
        ),
        (
            ["--cp", "3", "--seq-length", "32"],
            "seq_length=32 is not divisible by 2*context_parallel_size = 2*3 = 6 (rule: seq_length % (2 * cp) == 0",
        ),
        (["--cp", "2", "--nproc-per-node", "4", "--dp", "2"], "world_size=4 != tp*cp*pp*dp = 2*2*2*2 = 16"),
    ],
)
def test_ptdp_train_exits_2_before_any_process(argv, message, capsys, monkeypatch):
    import ptdp.run.launch

    monkeypatch.setattr(ptdp.run.launch, "launch_local", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["train", "--train-iters", "1", *argv]) == 2
    assert message in capsys.readouterr().err
