"""``ptdp plan`` is a light command: it imports no torch, and a full search for a 1T-parameter GPT
on 3,072 GPUs costs under a second of CPU time as a whole process. The planner package imports
nothing of torch or the training code, and the trainer reaches the planner only through
:mod:`ptdp.run.planner_report`."""

from __future__ import annotations

import ast
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ptdp"
PUBLISHED = ROOT / "benchmarks" / "data" / "published_runs.csv"
#: the largest model of Narayanan et al. SC21 Table 1 (1T parameters) at its published size and batch
ONE_T = ["--model", "gpt-1008b", "--gpus", "3072", "--gpu", "a100-80gb", "--global-batch-size", "3072",
         "--seq-length", "2048"]
FORBIDDEN = ("torch", "ptdp.engine.step", "ptdp.train", "ptdp.run", "ptdp.commands", "ptdp.engine.groups",
             "ptdp.engine.comm")

PROBE = """
import contextlib, io, sys
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print("exit", code)
print("torch imported:", "torch" in sys.modules)
print("ptdp modules:", sorted(m for m in sys.modules if m.startswith("ptdp")))
"""


def _plan_in_subprocess(args: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", PROBE, "plan", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("extra", [[], ["--json"], ["--plot", "plan.png"]], ids=["table", "json", "plot"])
def test_plan_search_imports_no_torch(extra, tmp_path):
    out = _plan_in_subprocess(["--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "1536", *extra],
                              tmp_path)
    assert "exit 0" in out
    assert "torch imported: False" in out, out


def test_plan_validate_imports_no_torch(tmp_path):
    out = _plan_in_subprocess(["--validate", str(PUBLISHED)], tmp_path)
    assert "torch imported: False" in out, out


def _cpu_seconds_of(cmd: list[str], env: dict) -> float:
    """User + system CPU seconds of the child process running ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_one_trillion_parameter_search_costs_under_a_cpu_second(tmp_path):
    """The whole process (interpreter start, imports, search over every layout, report); the
    fastest of 3 runs, so that a busy machine does not fail it."""
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "ptdp.cli", "plan", *ONE_T]
    fastest = min(_cpu_seconds_of(cmd, env) for _ in range(3))
    assert fastest < 1.0, f"ptdp plan took {fastest:.2f} s of CPU for the 1T / 3,072-GPU search"


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:  # ``from ptdp import comm``: ptdp.engine.comm too
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def _is_forbidden(name: str) -> bool:
    """torch, the training code (ptdp.engine.step, groups and comm, the run layer, ptdp.train, the commands)."""
    return any(name == f or name.startswith(f + ".") or (f == "ptdp.train" and name.startswith(f))
               for f in FORBIDDEN)


def test_planner_package_imports_no_torch_or_training_code():
    for path in sorted((SRC / "planner").glob("*.py")):
        bad = sorted(n for n in _imported_modules(path) if _is_forbidden(n) or n.startswith("ptdp.run.calibration")
                     or n == "ptdp.run.planner_report")
        assert not bad, f"{path.name} imports {bad}"


def test_trainer_reaches_the_planner_through_planner_report_only():
    imported = _imported_modules(SRC / "run" / "trainer.py")
    assert not [n for n in imported if n == "ptdp.planner" or n.startswith("ptdp.planner.")], imported
    assert "ptdp.run.planner_report" in imported
