"""The ``ptdp train`` runs at (1,2,2) in float64 that the restart tests and the multi-node test
compare: the tiny model for :data:`ITERS` iterations, every iteration logged, evaluated before the
first, checkpoints every :data:`SAVE_INTERVAL` iterations; run with :func:`train_pp2_dp2`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers.cli import tiny_flags
from helpers.faults import KILL_AT_ITERATION_ENV, environment
from helpers.proc_helpers import Finished, run_together

ITERS, SAVE_INTERVAL, KILL_AT = 10, 3, 5
#: The tiny model's flags of every run here, before the layout, data and folders.
FLAGS = tiny_flags(train_iters=ITERS, log_interval=1, eval_interval=100, params_dtype="float64", no_progress=True)
LAYOUT = ["--tp", "1", "--pp", "2", "--dp", "2"]


def train_pp2_dp2(
    workspace: Path, name: str, extra: list[str], *, kill: bool, timeout: float | None = None
) -> Finished:
    """``ptdp train`` at (1,2,2), 4 workers, on ``workspace/docs`` with the data cache
    ``workspace/cache``, into ``name`` (run directory) and ``name``-ckpt (checkpoints, every
    :data:`SAVE_INTERVAL` iterations); with ``kill``, a worker is killed at :data:`KILL_AT` in the
    job's first attempt (``PTDP_TEST_KILL_AT_ITERATION``, :mod:`helpers.faults`)."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(workspace / "cache"), OMP_NUM_THREADS="1")
    env.pop(KILL_AT_ITERATION_ENV, None)
    if kill:
        env = environment(env, **{KILL_AT_ITERATION_ENV: str(KILL_AT)})
    cmd = [
        sys.executable,
        "-m",
        "ptdp.cli",
        "train",
        *FLAGS,
        *LAYOUT,
        "--data",
        str(workspace / "docs"),
        "--output-dir",
        str(workspace / name),
        "--save",
        str(workspace / f"{name}-ckpt"),
        "--save-interval",
        str(SAVE_INTERVAL),
        *extra,
    ]
    (proc,) = run_together([cmd], timeout=timeout, env=env, cwd=workspace)
    return proc


def metric_lines(run_dir: Path) -> list[dict]:
    """Every line of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_per_iteration(lines: list[dict]) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) per iteration, the last line written for it (the resumed one)."""
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in lines if "loss" in r}
