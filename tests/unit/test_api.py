"""The Python API (docs/api.md): ``ptdp.plan`` answers as ``ptdp plan`` does, with the same rules;
``ptdp.load_config`` checks a file and keywords by ``ptdp train``'s rules; the runnable example."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ptdp
from ptdp.cli import main as cli_main
from ptdp.planner.inputs.models import get_model

ROOT = Path(__file__).resolve().parents[2]
REQUEST = dict(gpus=64, gpu="h100-sxm", global_batch_size=512, seq_length=4096)


def test_plan_equals_the_command_line_json(capsys):
    result = ptdp.plan("llama3-8b", **REQUEST, tp=2)
    code = cli_main(
        [
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            "64",
            "--gpu",
            "h100-sxm",
            "--global-batch-size",
            "512",
            "--seq-length",
            "4096",
            "--tp",
            "2",
            "--json",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result.to_json()))
    assert result.best is result.plans[0] and result.best.layout.tp == 2
    assert all(p.layout.tp == 2 for p in result.plans)
    steps = [p.time.step for p in result.plans]
    assert steps == sorted(steps)
    assert result.explanation[0] == "why #1:"
    assert any("best vs yours" in line or "the best layout" in line for line in result.explanation)
    assert "tp" in result.report(top=3)


def test_plan_takes_a_model_spec_and_shape_keywords():
    spec = get_model("llama3-8b")
    by_spec = ptdp.plan(spec, **REQUEST, recompute_granularity="full", use_distributed_optimizer=True)
    assert by_spec.model == dataclasses.replace(spec, seq_length=4096)  # the keyword applied to the spec
    assert {p.layout.recompute for p in by_spec.plans} == {"full"}
    assert {p.layout.sharding_strategy for p in by_spec.plans if p.layout.shard_size > 1} == {"optim"}
    shaped = ptdp.plan(
        None,
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        gpus=8,
        global_batch_size=64,
        pipeline_layer_split=[3, 5],
    )
    assert shaped.plans and {p.layout.layer_split for p in shaped.plans} == {(3, 5)}


@pytest.mark.parametrize(
    "options, error, words",
    [
        (dict(tp=3), ptdp.ConfigError, ["tp=3", "64 GPUs"]),
        (dict(recompute_granularity="bogus"), ptdp.ConfigError, ["--recompute-granularity", "bogus"]),
        (dict(tensor_parallel=2), TypeError, ["tensor_parallel", "tensor_model_parallel_size"]),
        (dict(gpus=None), ptdp.ConfigError, ["--gpus"]),
        (dict(tp=2, tensor_model_parallel_size=4), TypeError, ["'tp'", "'tensor_model_parallel_size'", "one option"]),
    ],
)
def test_plan_refuses_a_bad_request_naming_it(options, error, words):
    with pytest.raises(error) as caught:
        ptdp.plan("llama3-8b", **{**REQUEST, **options})
    for word in words:
        assert word in str(caught.value)


def test_plan_refuses_a_model_of_another_type():
    with pytest.raises(TypeError, match="a preset name, a config.json path or a ModelConfig, not 123"):
        ptdp.plan(123, **REQUEST)  # type: ignore[arg-type]


def test_load_config_refuses_two_names_of_one_option():
    with pytest.raises(TypeError, match="'mbs' and 'micro_batch_size', two names of one option"):
        ptdp.load_config(mbs=1, micro_batch_size=2, world_size=1)


def test_load_config_file_then_keywords(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "[parallel]\ntensor-model-parallel-size = 2\npipeline_model_parallel_size = 2\n"
        "[model]\nnum-layers = 4\nhidden-size = 64\nnum-attention-heads = 4\nseq-length = 64\n"
        "[train]\nmicro-batch-size = 2\nglobal-batch-size = 16\n",
        encoding="utf-8",
    )
    config = ptdp.load_config(path, world_size=8, pp=1, sequence_parallel=True, data=["a.txt", "b"])
    assert isinstance(config, ptdp.Config)
    assert (config.parallel.tp, config.parallel.pp, config.parallel.dp) == (2, 1, 4)  # keyword beats the file
    assert config.parallel.sequence_parallel and config.data.data_paths == ("a.txt", "b")
    assert config.num_microbatches == 2 and config.model.params_dtype == "float32"
    assert ptdp.load_config(path, world_size=4, cuda=True).model.params_dtype == "bfloat16"
    with pytest.raises(ptdp.ConfigError, match="world"):
        ptdp.load_config(path, world_size=6)
    with pytest.raises(TypeError, match="train_iter"):
        ptdp.load_config(path, world_size=4, train_iter=3)


def test_train_is_the_callable_worker_module():
    import ptdp.train as module

    assert ptdp.train is module and callable(ptdp.train) and callable(module.main)


def test_example_runs_and_the_planner_imports_no_torch():
    """docs/api.md's runnable example, as a user runs it; then no torch in the process."""
    code = (
        "import runpy, sys; runpy.run_path('examples/plan_from_python.py', run_name='__main__'); "
        "print('torch imported:', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "s per step" in out.stdout and "refused: invalid plan request" in out.stdout
    assert "config: tp 2 pp 2 dp 2, 4 microbatches per step" in out.stdout
    assert out.stdout.strip().endswith("torch imported: False")


def test_type_checkers_see_the_api_s_types(tmp_path):
    """``py.typed`` is only worth its annotations if a type checker reaches them: mypy reads
    ``ptdp.plan``, ``ptdp.load_config``, ``ptdp.train`` and ``ptdp.ConfigError`` with their types, not
    as ``Any`` from the package's lazy ``__getattr__``, and the runnable example type-checks."""
    pytest.importorskip("mypy")
    user = tmp_path / "user.py"
    user.write_text(
        "import ptdp\n"
        "result = ptdp.plan('llama3-8b', gpus=8, global_batch_size=8)\n"
        "reveal_type(result)\n"
        "reveal_type(result.best)\n"
        "reveal_type(ptdp.load_config(world_size=2))\n"
        "reveal_type(ptdp.train)\n"
        "reveal_type(ptdp.ConfigError)\n"
    )
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--python-version", "3.10"]
    out = subprocess.run(
        [*cmd, str(user), str(ROOT / "examples" / "plan_from_python.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for revealed in (
        '"ptdp.api.PlanResult"',
        '"ptdp.planner.candidate.Plan | None"',
        '"ptdp.config.schema.Config"',
        '"def (config: ptdp.config.schema.Config, *, progress: bool =) -> dict[Any, Any]"',
    ):
        assert f"Revealed type is {revealed}" in out.stdout, out.stdout
    assert '-> ptdp.errors.ConfigError"' in out.stdout, out.stdout  # the class, not Any
