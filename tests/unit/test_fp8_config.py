"""The FP8 section of the schema: Megatron-Core's flags (and ``--fp8``) reach ``ptdp train``'s and
``ptdp plan``'s config, a config file round trip keeps them, and bad values exit 2 naming them."""

from __future__ import annotations

import argparse
import json

import pytest

from helpers.cli import tiny_flags
from ptdp.config.flags import config_from_args
from ptdp.config.fp8 import FP8Config
from ptdp.config.rules.fp8 import fp8_violations
from ptdp.config.schema import Config
from ptdp.config.train_flags import add_train_arguments


def _config(argv: str) -> Config:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    return config_from_args(parser.parse_args(argv.split()))


def test_flags_reach_the_config_and_round_trip():
    cfg = _config(
        "--fp8-format e4m3 --fp8-recipe rowwise --fp8-margin 2 --fp8-amax-history-len 16 "
        "--fp8-amax-compute-algo max --fp8-emulate"
    )
    assert cfg.fp8 == FP8Config("e4m3", "rowwise", 2, 16, "max", True) and cfg.fp8.enabled
    assert Config.from_dict(cfg.to_dict()).fp8 == cfg.fp8
    assert _config("--fp8").fp8 == FP8Config(fp8_format="hybrid")
    assert (
        not _config("").fp8.enabled
        and Config.from_dict({k: v for k, v in cfg.to_dict().items() if k != "fp8"}).fp8 == FP8Config()
    )


@pytest.mark.parametrize(
    ("fp8", "words"),
    [
        (FP8Config(fp8_recipe="rowwise"), "fp8_recipe='rowwise' without --fp8-format"),
        (FP8Config(fp8_emulate=True), "fp8_emulate=True without --fp8-format"),
        (FP8Config(fp8_format="hybrid", fp8_margin=-1), "fp8_margin=-1 must be an integer >= 0"),
        (FP8Config(fp8_format="hybrid", fp8_amax_history_len=0), "fp8_amax_history_len=0 must be an integer >= 1"),
    ],
)
def test_rules_name_the_value(fp8, words):
    assert [words in v.message for v in fp8_violations(fp8)] == [True]


def test_valid_choices_pass():
    assert fp8_violations(FP8Config()) == []
    assert fp8_violations(FP8Config("e4m3", "blockwise", 1, 4, "max", True)) == []


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--fp8-recipe", "tensorwise"], "without --fp8-format"),
        (["--fp8", "--fp8-margin", "-1"], "fp8_margin=-1"),
        (["--fp8-format", "e5m2"], "invalid choice"),
    ],
)
def test_ptdp_train_exits_2_before_any_worker(capsys, extra, words):
    assert _exit_code(["train", "--tp", "1", "--pp", "1", "--dp", "1", "--train-iters", "1", *extra]) == 2
    assert words in capsys.readouterr().err


def test_ptdp_train_runs_fp8_experts(tmp_path):
    """FP8 with a mixture of experts trains (the experts' FP8 GEMMs, ptdp.engine.moe.expert_fp8)."""
    tiny = tiny_flags(train_iters=1, eval_interval=None, log_interval=None, no_progress=True)
    argv = ["train", *tiny, "--tp", "1", "--pp", "1", "--dp", "1", "--fp8", "--num-experts", "4"]
    assert _exit_code([*argv, "--moe-router-topk", "2", "--output-dir", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["fp8"]["fp8_format"] == "hybrid" and config["moe"]["num_experts"] == 4
    assert (tmp_path / "run" / "summary.json").is_file()


def _exit_code(argv: list[str]) -> int:
    from ptdp import cli

    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        return int(e.code or 0)


def test_ptdp_plan_takes_the_same_flags(capsys):
    base = ["plan", "--model", "llama2-7b", "--gpu", "h100-sxm", "--gpus", "8", "--top", "1"]
    assert _exit_code([*base, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--json"]) == 0
    assert _exit_code([*base, "--fp8-format", "e5m2"]) == 2
