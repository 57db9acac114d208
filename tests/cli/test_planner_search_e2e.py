"""``ptdp plan`` as a command: the table, JSON and plot of a search, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import budget


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ptdp.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=budget.seconds(),
        cwd=cwd,
    )


def test_cli_table_json_and_plot(tmp_path):
    args = [
        "--model",
        "gpt3-175b",
        "--gpus",
        "1024",
        "--gpus-per-node",
        "8",
        "--gpu",
        "a100-80gb",
        "--global-batch-size",
        "1536",
        "--seq-length",
        "2048",
    ]
    text = run_cli(*args, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "best: tp=" in text.stdout and "rejected:" in text.stdout and "crosses nodes" in text.stdout
    out = run_cli(*args, "--json", "--top", "3", "--plot", str(tmp_path / "plan.png"), cwd=tmp_path)
    plans = json.loads(out.stdout)
    keys = {
        "tp",
        "pp",
        "dp",
        "micro_batch_size",
        "virtual_stages",
        "recompute",
        "sequence_parallel",
        "distributed_optimizer",
        "fits",
        "memory_bytes",
        "time_s",
        "tflops_per_gpu",
        "mfu",
        "reasons",
    }
    assert all(keys <= set(p) for p in plans)
    assert [p["fits"] for p in plans[:3]] == [True] * 3 and not plans[-1]["fits"] and plans[-1]["reasons"]
    assert set(plans[0]["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "overhead", "total"}
    assert set(plans[0]["time_s"]) >= {
        "compute",
        "recompute",
        "tp_comm",
        "pp_comm",
        "bubble",
        "dp_comm",
        "optimizer",
        "step",
    }
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_cli_errors_are_clear(tmp_path):
    bad_gpu = run_cli("--model", "gpt3-175b", "--gpus", "8", "--global-batch-size", "8", "--gpu", "r200", cwd=tmp_path)
    assert bad_gpu.returncode == 2 and "unknown GPU 'r200'" in bad_gpu.stderr and "Traceback" not in bad_gpu.stderr
    no_model = run_cli("--gpus", "8", "--global-batch-size", "8", cwd=tmp_path)
    assert no_model.returncode == 2 and "give --model NAME or the model shape" in no_model.stderr
