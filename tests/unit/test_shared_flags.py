"""ptdp train and ptdp plan share every flag of a shared setting: name, aliases, type, choices
(generated from one schema field); plan's defaults are None ("search" or "the preset's")."""

from __future__ import annotations

import argparse

import pytest

from ptdp.config.flags import settings
from ptdp.config.train_flags import add_train_arguments
from ptdp.errors import ConfigError
from ptdp.planner.inputs.plan_flags import add_plan_arguments, plan_precision


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in parser._actions for opt in action.option_strings}


def test_every_shared_setting_has_the_same_flags_in_train_and_plan():
    train, plan = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_train_arguments(train, local_launch=True)
    add_plan_arguments(plan)
    t, p = _options(train), _options(plan)
    shared = [s for s in settings() if s.flag.plan and s.flag.train]  # plan-only settings aside
    assert {s.name for s in shared} >= {
        "num_layers",
        "hidden_size",
        "tensor_model_parallel_size",
        "micro_batch_size",
        "recompute_granularity",
        "sequence_parallel",
        "params_dtype",
    }
    for s in shared:
        for name in (s.flag.name, *s.flag.aliases, *(n for n, _, _ in s.flag.shortcuts)):
            assert name in t and name in p, name
            assert t[name].dest == p[name].dest == s.dest
            assert t[name].choices == p[name].choices, name
            assert p[name].default is None or p[name].const is not None, name
    assert t["--recompute-granularity"].choices == ("full", "selective", "none")


def test_the_two_commands_read_recompute_none_and_precision_alike():
    train, plan = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_train_arguments(train, local_launch=True)
    add_plan_arguments(plan)
    assert train.parse_args(["--recompute-granularity", "none"]).recompute_granularity is None  # unset
    assert plan.parse_args(["--recompute-granularity", "none"]).recompute_granularity == "none"  # fixed, not searched
    assert plan.parse_args([]).recompute_granularity is None  # searched
    for flag, dtype, precision in (
        ("--bf16", "bfloat16", "bf16"),
        ("--fp16", "float16", "fp16"),
        ("--fp32", "float32", "fp32"),
    ):
        assert train.parse_args([flag]).params_dtype == dtype
        assert plan_precision(plan.parse_args([flag])) == precision
    with pytest.raises(ConfigError, match="the planner models bfloat16, float16 and float32"):
        plan_precision(plan.parse_args(["--params-dtype", "float64"]))
