"""``--async-save`` from the command line: checkpoints written in the background while training
goes on; the end of training waits for the last one; resuming equals the uninterrupted run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.cli import TINY, run


def _train_losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in lines if "loss" in r}


def test_async_save_and_resume_from_the_command_line(corpus, tmp_path):
    """6 iterations in one run == 3 with an asynchronous save after each (the last completed by
    the end of training, --keep-last 2), then resumed from the newest for 3 more (bitwise)."""
    base = [sys.executable, "-m", "ptdp.train", *TINY, "--tp", "1", "--pp", "1", "--data", str(corpus / "docs"),
            "--no-progress", "--log-interval", "1", "--lr-decay-iters", "6"]
    whole = run(base + ["--output-dir", str(tmp_path / "whole")], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    first = run(base + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1", "--keep-last", "2",
                        "--async-save", "--output-dir", str(tmp_path / "first")], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "written in the background" in first.stderr, first.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    second = run(base + ["--load", str(ckpt), "--output-dir", str(tmp_path / "second")], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    expected = _train_losses(tmp_path / "whole")
    assert _train_losses(tmp_path / "second") == {i: expected[i] for i in (4, 5, 6)}
