"""``ptdp train`` with a NaN loss at every step: the skipped steps are tolerated up to the limit,
every checkpoint holds the unchanged finite state, then the run stops naming the iteration."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers.checkpoints import stored_tensors
from helpers.cli import TINY, run
from helpers.faults import NAN_LOSS_ENV, environment
from ptdp.engine.step import NONFINITE_LOSS


@pytest.mark.slow
def test_nan_every_step_stops_after_the_limit(corpus, tmp_path):
    """ptdp train, 2 workers (tp1 pp2): a NaN loss at every step; three skipped steps are tolerated (each
    logged and warned about, each checkpoint holds the unchanged finite state), the fourth stops
    the run naming the iteration."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--tp",
            "1",
            "--pp",
            "2",
            "--dp",
            "1",
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
            "--max-skipped-steps",
            "3",
            "--save",
            str(ckpt),
            "--save-interval",
            "1",
        ],
        tmp_path,
        env=environment(os.environ, **{NAN_LOSS_ENV: "0:every"}),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "is not finite at iteration 4 (non-finite loss on some rank): 4 such steps in a row, "
        "more than --max-skipped-steps 3; stopping"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("the step is skipped on every rank, no update") == 3
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert [(r["iteration"], r["skipped"], r["reason"], r["loss"]) for r in train] == [
        (i, True, NONFINITE_LOSS, None) for i in (1, 2, 3, 4)
    ]
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    saved = sorted(p.name for p in ckpt.iterdir())
    assert saved == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    first = stored_tensors(ckpt / "iter_0000001")
    for folder in saved[:-1]:
        tensors = stored_tensors(ckpt / folder)
        assert all(torch.isfinite(t).all() for t in tensors.values()), folder
        assert all(torch.equal(t, first[k]) for k, t in tensors.items()), "no update was ever made"
