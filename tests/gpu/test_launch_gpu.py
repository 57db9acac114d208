"""ptdp train's launch on real GPUs (skipped without CUDA, or with fewer GPUs than a test needs):
an NCCL collective that times out (a rank stalled by the test hook) ends the run with the stalled
rank named with its phase and iteration, and --async-save checkpoints resume on NCCL."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import faults
from helpers.cli import TINY, run

pytestmark = pytest.mark.gpu


def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


def _base(corpus: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ptdp.cli",
        "train",
        *TINY,
        "--tp",
        "1",
        "--pp",
        "1",
        "--dp",
        "2",
        "--params-dtype",
        "float32",
        "--data",
        str(corpus / "docs"),
        "--no-progress",
    ]


@gpus(2)
@pytest.mark.timeout(600)
def test_an_nccl_timeout_names_the_stalled_rank(corpus, tmp_path):
    """Rank 1 sleeps in gradient sync at iteration 2; rank 0's all-reduce times out after 6 s and
    NCCL's watchdog aborts it. The message names rank 1, its phase and iteration."""
    cmd = _base(corpus) + ["--distributed-timeout-minutes", "0.1", "--output-dir", str(tmp_path / "run")]
    proc = run(cmd, tmp_path, env=faults.environment(os.environ, **{faults.STALL_ENV: "1:2:gradient sync:300"}))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "worker rank 1 (local rank 1, pid " in proc.stderr, proc.stderr[-3000:]
    assert "failed first, in gradient sync at iteration 2" in proc.stderr, proc.stderr[-3000:]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in lines if "loss" in r}


@gpus(2)
@pytest.mark.timeout(900)
def test_async_save_resumes_on_nccl(corpus, tmp_path):
    base = _base(corpus) + ["--log-interval", "1", "--lr-decay-iters", "6"]
    whole = run(base + ["--output-dir", str(tmp_path / "whole")], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    first = run(
        base
        + [
            "--train-iters",
            "3",
            "--save",
            str(ckpt),
            "--save-interval",
            "1",
            "--async-save",
            "--output-dir",
            str(tmp_path / "first"),
        ],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    second = run(base + ["--load", str(ckpt), "--output-dir", str(tmp_path / "second")], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    expected, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "second")
    assert sorted(resumed) == [4, 5, 6]
    for it, loss in resumed.items():
        assert loss == pytest.approx(expected[it], rel=1e-5)
