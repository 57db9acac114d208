"""``ptdp plan`` is a light command: run as a process it imports no torch, and a full search for a
1T-parameter GPT on 3,072 GPUs evaluates a bounded number of layouts, each once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench_scripts import import_scripts

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "data" / "published_runs.csv"


PROBE = """
import contextlib, io, sys
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print("exit", code)
print("torch imported:", "torch" in sys.modules)
print("ptdp modules:", sorted(m for m in sys.modules if m.startswith("ptdp")))
"""


def _in_subprocess(args: list[str], tmp_path: Path, code: str = PROBE) -> str:
    """The output of ``code`` run as ``python -c code ARGS`` (ptdp's CLI arguments), which must exit 0."""
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("extra", [[], ["--json"], ["--plot", "plan.png"]], ids=["table", "json", "plot"])
def test_plan_search_imports_no_torch(extra, tmp_path):
    out = _in_subprocess(
        ["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "1536", *extra], tmp_path
    )
    assert "exit 0" in out
    assert "torch imported: False" in out, out


def test_plan_validate_imports_no_torch(tmp_path):
    out = _in_subprocess(["plan", "--validate", str(PUBLISHED)], tmp_path)
    assert "torch imported: False" in out, out


COUNT = """
import contextlib, io, sys
import ptdp.commands.plan as command
results = []
def counted(*args, **kwargs):
    result = search(*args, **kwargs)
    results.append(result)
    return result
search, command.search = command.search, counted
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
layouts = [p.layout for r in results for p in [*r.plans, *(plan for plan, _ in r.rejected)]]
print("exit", code)
print("torch imported:", "torch" in sys.modules)
print("evaluated:", sum(r.evaluated for r in results), "distinct:", len(set(layouts)), "fitting:", sum(len(r.plans) for r in results))
"""

#: the layouts the 1T search may evaluate: every (tp, cp, pp, dp, v, micro-batch, recompute,
#: sharding) it tries is counted, whatever the machine's speed (the CPU time is a benchmark:
#: benchmarks/bench_plan_process.py)
MAX_LAYOUTS = 10_000


def test_one_trillion_parameter_search_is_bounded_and_imports_no_torch(tmp_path, monkeypatch):
    """The 1T / 3,072-GPU search as a process: no torch, each layout evaluated once, at most
    MAX_LAYOUTS of them, and some fit."""
    (bench,) = import_scripts(monkeypatch, "bench_plan_process")  # the search its benchmark times
    out = _in_subprocess(["plan", *bench.ONE_T], tmp_path, COUNT)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "exit 0" in out and lines["torch imported"] == "False", out
    counts = lines["evaluated"].split()
    evaluated, distinct, fitting = int(counts[0]), int(counts[2]), int(counts[4])
    assert 0 < fitting <= evaluated == distinct <= MAX_LAYOUTS, out


def test_schedule_command_imports_no_torch(tmp_path):
    """``ptdp schedule`` (programs, the NCCL model, the bubble) is pure: no torch in the process."""
    args = ["schedule", "--pipeline-schedule", "interleaved-1f1b", "--pp", "4", "--num-microbatches", "16", "--json"]
    out = _in_subprocess(args, tmp_path)
    assert "exit 0" in out and "torch imported: False" in out


def test_a_bad_train_request_is_answered_without_importing_torch(tmp_path):
    """With a CPU-only torch, ``ptdp train``'s rules run before torch is imported: a bad request
    is answered (exit 2, the rule named) in a fraction of a second, not after torch's import."""
    from ptdp.config.train_flags import cpu_only_torch

    if not cpu_only_torch():
        pytest.skip("a CUDA build of torch: ptdp train asks it for the visible GPUs")
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "--tp", "3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "exit 2" in proc.stdout and "torch imported: False" in proc.stdout, proc.stdout
    assert "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3" in proc.stderr
