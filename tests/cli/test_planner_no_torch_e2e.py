"""``ptdp plan``, ``ptdp schedule`` and a bad ``ptdp train`` request are light: run as a process
they import no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import PROBE, in_subprocess

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_runs.csv"


@pytest.mark.parametrize("extra", [[], ["--json"], ["--plot", "plan.png"]], ids=["table", "json", "plot"])
def test_plan_search_imports_no_torch(extra, tmp_path):
    out = in_subprocess(
        ["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "1536", *extra], tmp_path
    )
    assert "exit 0" in out
    assert "torch imported: False" in out, out


def test_plan_validate_imports_no_torch(tmp_path):
    out = in_subprocess(["plan", "--validate", str(PUBLISHED)], tmp_path)
    assert "torch imported: False" in out, out


def test_schedule_command_imports_no_torch(tmp_path):
    """``ptdp schedule`` (programs, the NCCL model, the bubble) is pure: no torch in the process."""
    args = ["schedule", "--pipeline-schedule", "interleaved-1f1b", "--pp", "4", "--num-microbatches", "16", "--json"]
    out = in_subprocess(args, tmp_path)
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
