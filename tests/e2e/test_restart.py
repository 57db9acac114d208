"""Restarts: a worker killed (SIGKILL) after the first checkpoint; with ``--max-restarts 1`` the
launcher restarts the job, which resumes from the newest checkpoint in ``--save`` and trains
exactly like an uninterrupted run; with ``--max-restarts 0`` the run fails, naming the dead rank.

The kill is the test-only fault of :mod:`helpers.faults`
(``PTDP_TEST_KILL_AT_ITERATION``), which fires in the job's first attempt only. The runs, their
corpus and data cache, and the uninterrupted run (shared with tests/e2e/test_multinode.py):
helpers/pp2_dp2_runs.py and tests/e2e/conftest.py."""

from __future__ import annotations

import os
import sys

import pytest

from helpers.faults import environment
from helpers.pp2_dp2_runs import (
    FLAGS,
    ITERS,
    KILL_AT,
    SAVE_INTERVAL,
    last_per_iteration,
    metric_lines,
    train_pp2_dp2,
)
from helpers.proc_helpers import run_together


@pytest.fixture
def workspace(pp2_dp2_workspace):
    """The corpus and data cache of the (1,2,2) runs; each test's runs write folders of their own."""
    return pp2_dp2_workspace


@pytest.fixture
def uninterrupted(pp2_dp2_uninterrupted, pp2_dp2_workspace) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) per iteration of the uninterrupted (1,2,2) run."""
    return last_per_iteration(metric_lines(pp2_dp2_workspace / "whole"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # with the uninterrupted run; about 40 s on an idle 2-core machine
def test_killed_worker_is_restarted_and_the_run_resumes_bitwise(workspace, uninterrupted):
    proc = train_pp2_dp2(workspace, "killed", ["--max-restarts", "1"], kill=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1 of the job: resumed from" in proc.stderr
    records = metric_lines(workspace / "killed")
    assert last_per_iteration(records) == uninterrupted, "losses and gradient norms bitwise"
    events = [r for r in records if r.get("event") == "restart"]
    assert len(events) == 1 and events[0]["restart"] == 1
    resumed = events[0]["resumed_from_iteration"]
    assert resumed == KILL_AT // SAVE_INTERVAL * SAVE_INTERVAL
    assert events[0]["checkpoint"].endswith(f"iter_{resumed:07d}")
    after = records[records.index(events[0]) :]
    assert all(r.get("restart") == 1 for r in after), "every line of the resumed part is marked"
    assert all("restart" not in r for r in records[: records.index(events[0])])
    first = {r["iteration"] for r in records if "loss" in r and "restart" not in r}
    second = {r["iteration"] for r in records if "loss" in r and r.get("restart") == 1}
    recomputed = first & second
    # rank 0 may be stopped before it logs the iteration at which rank 1 died
    assert set(range(1, KILL_AT)) <= first <= set(range(1, KILL_AT + 1))
    assert second == set(range(resumed + 1, ITERS + 1))
    assert 0 < len(recomputed) <= SAVE_INTERVAL, recomputed


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_naming_the_rank(workspace):
    proc = train_pp2_dp2(workspace, "fails", [], kill=True)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "ptdp train: error: worker rank 1 (local rank 1" in proc.stderr
    assert "killed by signal SIGKILL" in proc.stderr and "--max-restarts 0" in proc.stderr
    records = metric_lines(workspace / "fails")
    assert max(r["iteration"] for r in records if "loss" in r) in (KILL_AT - 1, KILL_AT)
    assert not any("restart" in r for r in records)


@pytest.mark.slow
@pytest.mark.timeout(600)  # with the uninterrupted run when run alone
def test_torchrun_restart_resumes(workspace, uninterrupted):
    """``torchrun --max-restarts 1 -m ptdp.train`` at (1,2,1): the restarted workers resume from
    --save and end like the (1,2,2) run (float64 layout equivalence, 1e-9)."""
    env = environment(
        os.environ,
        PTDP_CACHE_DIR=str(workspace / "cache"),
        OMP_NUM_THREADS="1",
        PTDP_TEST_KILL_AT_ITERATION=str(KILL_AT),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "ptdp.train",
        *FLAGS,
        "--tp",
        "1",
        "--pp",
        "2",
        "--data",
        str(workspace / "docs"),
        "--output-dir",
        str(workspace / "torchrun"),
        "--save",
        str(workspace / "torchrun-ckpt"),
        "--save-interval",
        str(SAVE_INTERVAL),
    ]
    (proc,) = run_together([cmd], env=env, cwd=workspace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metric_lines(workspace / "torchrun")
    assert [r["resumed_from_iteration"] for r in records if r.get("event") == "restart"] == [3]
    losses = last_per_iteration(records)
    assert sorted(losses) == sorted(uninterrupted)
    for it, (loss, norm) in uninterrupted.items():
        assert losses[it][0] == pytest.approx(loss, rel=1e-9) and losses[it][1] == pytest.approx(norm, rel=1e-9)
