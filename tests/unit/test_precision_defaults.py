"""--params-dtype auto (the default): bfloat16 when the workers train on CUDA GPUs, float32 on the
CPU, made concrete before any process starts; ptdp plan plans bfloat16; TF32 for float32 GEMMs
only on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from ptdp import cli
from ptdp.config.model import ModelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config
from ptdp.engine.stage import allow_tf32
from ptdp.errors import ConfigError
from ptdp.planner.inputs.plan_flags import plan_precision


def test_auto_is_bfloat16_on_cuda_and_float32_on_the_cpu():
    assert ModelConfig().params_dtype == "auto"
    assert resolve(Config(), 8).model.params_dtype == "float32"
    assert resolve(Config(), 8, cuda=True).model.params_dtype == "bfloat16"
    for explicit in ("float32", "float64", "float16"):
        assert resolve(Config(model=ModelConfig(params_dtype=explicit)), 8, cuda=True).model.params_dtype == explicit
    with pytest.raises(ConfigError, match=r"params_dtype='int8' must be one of \('auto', 'float32'"):
        resolve(Config(model=ModelConfig(params_dtype="int8")), 8)


@pytest.mark.parametrize("gpus, expected", [(None, "float32"), (8, "bfloat16")])
def test_ptdp_train_resolves_auto_from_the_visible_gpus(monkeypatch, capsys, gpus, expected):
    import ptdp.commands.train as train_command

    monkeypatch.setattr(train_command, "visible_gpus", lambda: gpus)
    assert cli.main(["train", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params_dtype"] == expected


def test_ptdp_plan_plans_auto_as_bf16():
    class Args:
        params_dtype = "auto"

    assert plan_precision(Args()) == "bf16"


def test_tf32_only_on_cuda():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        allow_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        allow_tf32(torch.device("cuda"))  # a device object needs no GPU
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
