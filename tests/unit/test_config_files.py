"""--config FILE (TOML, YAML, JSON), --print-config, and replaying a run from its config.json."""

from __future__ import annotations

import json

import pytest

from ptdp import cli


def printed(capsys, *argv: str) -> dict:
    assert cli.main(["train", *argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "c.toml",
            "tp = 4\npp = 1\n[model]\nnum-layers = 8\nhidden_size = 64\ndisable-bias-linear = true\n"
            'recompute-granularity = "full"\n[train]\nlr = 0.001\ndata = ["a", "b"]\n',
        ),
        (
            "c.yaml",
            "tensor-model-parallel-size: 4\npipeline_model_parallel_size: 1\nmodel:\n  num_layers: 8\n"
            "  hidden-size: 64\n  add_bias_linear: false\n  recompute_granularity: full\nlr: 0.001\n"
            "data: [a, b]\n",
        ),
        (
            "c.json",
            '{"parallel": {"tp": 4, "pp": 1}, "num-layers": 8, "hidden_size": 64, "disable_bias_linear": true, '
            '"recompute-granularity": "full", "train": {"lr": 0.001}, "data_paths": ["a", "b"]}',
        ),
    ],
)
def test_a_config_file_sets_flags_by_their_long_names(tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    c = printed(capsys, "--config", str(path))
    assert (c["parallel"]["tensor_model_parallel_size"], c["parallel"]["pipeline_model_parallel_size"]) == (4, 1)
    assert (c["model"]["num_layers"], c["model"]["hidden_size"], c["model"]["add_bias_linear"]) == (8, 64, False)
    assert c["model"]["recompute_granularity"] == "full" and c["train"]["lr"] == 0.001
    assert c["data"]["data_paths"] == ["a", "b"] and c["parallel"]["data_parallel_size"] == 2


def test_the_command_line_overrides_the_file(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('tp = 4\npp = 1\nnum-layers = 8\ndata = ["a"]\nsequence-parallel = true\n')
    c = printed(capsys, "--config", str(path), "--tp", "2", "--data", "z", "--no-sequence-parallel")
    assert c["parallel"]["tensor_model_parallel_size"] == 2 and c["model"]["num_layers"] == 8
    assert c["data"]["data_paths"] == ["z"] and c["parallel"]["sequence_parallel"] is False


def test_print_config_round_trips_through_config(tmp_path, capsys):
    first = printed(capsys, "--tp", "1", "--pp", "4", "--num-layers", "8", "--swiglu", "--bf16")
    (tmp_path / "c.json").write_text(json.dumps(first))
    assert printed(capsys, "--config", str(tmp_path / "c.json")) == first


def test_a_printed_config_with_other_iterations_decays_over_them(tmp_path, capsys):
    """The decay and warmup steps that follow --train-iters are not written as fixed numbers:
    a config printed for 5 steps, run for 300, decays over 300 and warms up over 30."""
    from ptdp.config.schema import Config

    short = printed(capsys, "--train-iters", "5")
    assert short["train"]["lr_decay_iters"] is None and short["train"]["lr_warmup_iters"] is None
    (tmp_path / "c.json").write_text(json.dumps(short))
    train = Config.from_dict(printed(capsys, "--config", str(tmp_path / "c.json"), "--train-iters", "300")).train
    assert (train.train_iters, train.decay_iters, train.warmup_iters) == (300, 300, 30)
    given = printed(capsys, "--train-iters", "5", "--lr-decay-iters", "4", "--lr-warmup-iters", "1")["train"]
    assert (given["lr_decay_iters"], given["lr_warmup_iters"]) == (4, 1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_layer = 3\n", "unknown key 'num_layer'; did you mean 'num-layers'?"),
        ("[model]\nhiden-size = 3\n", "unknown key 'model.hiden-size'; did you mean 'hidden-size'?"),
        ("num-layers = 2.5\n", "num-layers=2.5 must be a int"),
        ('normalization = "BatchNorm"\n', "normalization='BatchNorm' must be one of ('LayerNorm', 'RMSNorm')"),
        ('swiglu = "yes"\n', "swiglu='yes' must be true or false"),
        ("tp = \n", "not valid toml"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ptdp train: error: --config {path}: ") and message in err, err


def test_a_missing_config_file_is_named(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config {tmp_path / 'nope.toml'}: cannot read it" in capsys.readouterr().err


def test_the_rules_still_apply_to_a_config_file(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("tp: 3\n")
    assert cli.main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3" in capsys.readouterr().err
