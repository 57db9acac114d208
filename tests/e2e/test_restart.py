"""Restarts: a worker killed (SIGKILL) after the first checkpoint; with ``--max-restarts 1`` the
launcher restarts the job, which resumes from the newest checkpoint in ``--save`` and trains
exactly like an uninterrupted run; with ``--max-restarts 0`` the run fails, naming the dead rank.

The kill is the test-only hook :meth:`ptdp.engine.faults.FaultPlan.kill_after`
(``PTDP_TEST_KILL_AT_ITERATION``), which fires in the job's first attempt only."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers.proc_helpers import run_together
from helpers.cli import tiny_flags, write_docs


ITERS, SAVE_INTERVAL, KILL_AT = 10, 3, 5
TINY = tiny_flags(train_iters=ITERS, log_interval=1, eval_interval=100, params_dtype="float64", no_progress=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A small real-text corpus and a shared data cache (tokenized once, by the first run)."""
    root = tmp_path_factory.mktemp("restart")
    write_docs(root / "docs", 16)
    return root


def _train(workspace: Path, name: str, extra: list[str], *, kill: bool, timeout: float | None = None):
    """``ptdp train`` at (1,2,2), 4 workers, into ``name`` (run directory) and ``name``-ckpt (checkpoints)."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(workspace / "cache"), OMP_NUM_THREADS="1")
    env.pop("PTDP_TEST_KILL_AT_ITERATION", None)
    if kill:
        env["PTDP_TEST_KILL_AT_ITERATION"] = str(KILL_AT)
    cmd = [sys.executable, "-m", "ptdp.cli", "train", *TINY, "--tp", "1", "--pp", "2", "--dp", "2",
           "--data", str(workspace / "docs"),
           "--output-dir", str(workspace / name), "--save", str(workspace / f"{name}-ckpt"),
           "--save-interval", str(SAVE_INTERVAL), *extra]
    (proc,) = run_together([cmd], timeout=timeout, env=env, cwd=workspace)
    return proc


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last_per_iteration(records: list[dict]) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) per iteration, the last line written for it (the resumed one)."""
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(workspace) -> dict[int, tuple[float, float]]:
    proc = _train(workspace, "whole", [], kill=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _last_per_iteration(_records(workspace / "whole"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # with the uninterrupted run; about 40 s on an idle 2-core machine
def test_killed_worker_is_restarted_and_the_run_resumes_bitwise(workspace, uninterrupted):
    proc = _train(workspace, "killed", ["--max-restarts", "1"], kill=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1 of the job: resumed from" in proc.stderr
    records = _records(workspace / "killed")
    assert _last_per_iteration(records) == uninterrupted, "losses and gradient norms bitwise"
    events = [r for r in records if r.get("event") == "restart"]
    assert len(events) == 1 and events[0]["restart"] == 1
    resumed = events[0]["resumed_from_iteration"]
    assert resumed == KILL_AT // SAVE_INTERVAL * SAVE_INTERVAL
    assert events[0]["checkpoint"].endswith(f"iter_{resumed:07d}")
    after = records[records.index(events[0]):]
    assert all(r.get("restart") == 1 for r in after), "every line of the resumed part is marked"
    assert all("restart" not in r for r in records[:records.index(events[0])])
    first = {r["iteration"] for r in records if "loss" in r and "restart" not in r}
    second = {r["iteration"] for r in records if "loss" in r and r.get("restart") == 1}
    recomputed = first & second
    # rank 0 may be stopped before it logs the iteration at which rank 1 died
    assert set(range(1, KILL_AT)) <= first <= set(range(1, KILL_AT + 1))
    assert second == set(range(resumed + 1, ITERS + 1))
    assert 0 < len(recomputed) <= SAVE_INTERVAL, recomputed


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_naming_the_rank(workspace):
    proc = _train(workspace, "fails", [], kill=True)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "ptdp train: error: worker rank 1 (local rank 1" in proc.stderr
    assert "killed by signal SIGKILL" in proc.stderr and "--max-restarts 0" in proc.stderr
    records = _records(workspace / "fails")
    assert max(r["iteration"] for r in records if "loss" in r) in (KILL_AT - 1, KILL_AT)
    assert not any("restart" in r for r in records)


@pytest.mark.slow
@pytest.mark.timeout(600)  # with the uninterrupted run when run alone
def test_torchrun_restart_resumes(workspace, uninterrupted):
    """``torchrun --max-restarts 1 -m ptdp.train`` at (1,2,1): the restarted workers resume from
    --save and end like the (1,2,2) run (float64 layout equivalence, 1e-9)."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(workspace / "cache"), OMP_NUM_THREADS="1",
               PTDP_TEST_KILL_AT_ITERATION=str(KILL_AT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "ptdp.train", *TINY, "--tp", "1", "--pp", "2",
           "--data", str(workspace / "docs"), "--output-dir", str(workspace / "torchrun"),
           "--save", str(workspace / "torchrun-ckpt"), "--save-interval", str(SAVE_INTERVAL)]
    (proc,) = run_together([cmd], env=env, cwd=workspace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(workspace / "torchrun")
    assert [r["resumed_from_iteration"] for r in records if r.get("event") == "restart"] == [3]
    losses = _last_per_iteration(records)
    assert sorted(losses) == sorted(uninterrupted)
    for it, (loss, norm) in uninterrupted.items():
        assert losses[it][0] == pytest.approx(loss, rel=1e-9) and losses[it][1] == pytest.approx(norm, rel=1e-9)
