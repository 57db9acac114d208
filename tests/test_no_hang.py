"""A worker that stops responding makes the job fail within the process-group timeout (plus a
small margin), with a message naming the rank, the phase, the iteration and the stalled rank."""

from __future__ import annotations

import datetime
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from ptdp.engine import activity, faults
from ptdp.engine.comm import P2P, AxisGroup, CommStats, all_reduce, post
from dist_helpers import run_workers
from proc_helpers import run_together
from test_cli import TINY, corpus  # noqa: F401 - corpus is a fixture

TIMEOUT_S = 3.0


def stalled_peer_worker(rank: int, world: int) -> tuple:
    """Rank 2 stops responding; rank 0 waits for a pipeline recv from it, rank 1 in a dp all-reduce."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    groups = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 2], timeout=timeout)]
    if rank == 2:
        time.sleep(4 * TIMEOUT_S)
        return ("slept",)
    activity.start_step(rank, 4)
    stats = CommStats()
    try:
        if rank == 0:
            activity.set_phase(activity.PIPELINE)
            pp = AxisGroup("pp", (0, 2), 0, groups[0], stats, TIMEOUT_S)
            post([P2P("recv", torch.empty(3), peer=1)], pp)[0].wait()
        else:
            activity.set_phase(activity.GRAD_SYNC)
            all_reduce(torch.ones(3), AxisGroup("dp", (1, 2), 0, groups[1], stats, TIMEOUT_S))
    except activity.CollectiveError as e:
        return (type(e).__name__, str(e), e.rank, e.phase, e.iteration)
    return ("no error",)


@pytest.mark.slow
def test_a_timed_out_collective_names_rank_phase_iteration_and_the_stalled_rank():
    results = run_workers(stalled_peer_worker, 3)
    assert results[2] == ("slept",)
    kind, message, rank, phase, iteration = results[0]
    assert (kind, rank, phase, iteration) == ("CollectiveTimeout", 0, activity.PIPELINE, 4)
    assert message.startswith("rank 0 timed out after 0.05 min in pipeline send/recv at iteration 4: "
                              "pp recv from rank 2 did not complete (rank 2 reported no timeout of its own"), message
    kind, message, rank, phase, iteration = results[1]
    assert (kind, rank, phase, iteration) == ("CollectiveTimeout", 1, activity.GRAD_SYNC, 4)
    assert message.startswith("rank 1 timed out after 0.05 min in gradient sync at iteration 4: "
                              "dp all_reduce over ranks 1, 2 did not complete (rank 2 reported"), message


@pytest.mark.slow
def test_ptdp_train_with_a_stalled_worker_fails_within_the_timeout(corpus, tmp_path):  # noqa: F811
    """tp1 pp2 dp2, timeout 0.1 min: rank 1 sleeps at the start of iteration 2's gradient sync; the
    job ends within the timeout + the diagnosis grace (2 s) + 25 s for the workers and the launcher
    to exit on a busy 2-core machine, naming the stalled rank."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               **{faults.STALL_ENV: "1:2:gradient sync"})
    cmd = [sys.executable, "-m", "ptdp.cli", "train", *TINY, "--tp", "1", "--pp", "2", "--dp", "2",
           "--data", str(corpus / "docs"), "--output-dir", str(tmp_path / "run"), "--no-progress",
           "--distributed-timeout-minutes", "0.1"]
    [proc] = run_together([cmd], env=env, cwd=tmp_path)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    stalled = re.search(r"ptdp test stall: rank 1 sleeps in gradient sync at iteration 2 from ([\d.]+)", proc.stderr)
    assert stalled, proc.stderr[-3000:]
    assert ended - float(stalled.group(1)) < 6 + 2 + 25, ended - float(stalled.group(1))
    assert re.search(r"ptdp train: error: .*\n.*rank [023] timed out after 0.1 min in gradient sync at iteration 2: "
                     r".* did not complete \(rank 1 reported no timeout of its own", proc.stderr), proc.stderr[-3000:]


def test_fault_hooks_parse_and_reject_bad_values(monkeypatch):
    plan = lambda: faults.FaultPlan.from_env()  # noqa: E731 - read once per worker in ptdp, here per check
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "3:2,5")
    assert [plan().poisons(r, i) for r, i in ((3, 2), (3, 5), (3, 3), (2, 2))] == [True, True, False, False]
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "0:every")
    assert plan().poisons(0, 17) and not plan().poisons(1, 17)
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "0")
    with pytest.raises(ValueError, match="PTDP_TEST_NAN_LOSS='0': expected"):
        plan()
    monkeypatch.delenv(faults.NAN_LOSS_ENV)
    monkeypatch.setenv(faults.STALL_ENV, "1:2:gradient sync:0.5")
    assert plan().stall_phase(1, 2) == "gradient sync" and plan().stall_phase(1, 3) is None
    monkeypatch.setenv(faults.STALL_ENV, "1:2:grad sync")
    with pytest.raises(ValueError, match="phase 'grad sync' is not one of"):
        activity.start_step(1, 2, plan())
    monkeypatch.delenv(faults.STALL_ENV)
    assert plan() is None, "no test variable: no plan, nothing on the production path"
    activity.start_step(1, 2)
    assert activity.CURRENT.where() == "in forward at iteration 2"


def test_a_lost_peer_is_named_without_claiming_a_timeout():
    activity.set_phase(activity.BACKWARD, 9)
    err = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5. This is "
                       "typically caused by a remote worker crashing.")
    e = activity.collective_error(err, rank=4, axis="tp", op="all_reduce", ranks=(4, 5), timeout_s=120)
    assert type(e) is activity.CollectiveError
    assert str(e) == ("rank 4 failed in backward at iteration 9: tp all_reduce over ranks 4, 5: "
                      "Connection closed by peer [127.0.0.1]:5")
