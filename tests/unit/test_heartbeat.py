"""The heartbeat of a worker on NCCL names its rank, phase and iteration once it has made no
progress for most of the process-group timeout (ptdp.run.heartbeat)."""

from __future__ import annotations

import io
import time

import pytest

from ptdp.engine import activity
from ptdp.run.heartbeat import Heartbeat


@pytest.fixture
def fresh_activity(monkeypatch):
    monkeypatch.setattr(activity, "CURRENT", activity.Activity())
    monkeypatch.setattr(activity, "_mirror", None)


def _wait_for(predicate, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)


def test_a_stuck_phase_is_named_once_with_rank_and_iteration(fresh_activity):
    out = io.StringIO()
    activity.start_step(3, 7)
    activity.set_phase(activity.GRAD_SYNC)
    with Heartbeat(3, timeout_s=0.2, poll_s=0.01, out=out) as beat:
        _wait_for(lambda: beat.warnings)
        time.sleep(0.3)  # still stuck: no second line
    [line] = out.getvalue().splitlines()
    assert line.startswith("ptdp: rank 3 has made no progress for ") and (
        " in gradient sync at iteration 7 (90% of the process-group timeout, 0.00333333 min): if NCCL's watchdog "
        "aborts this process, this is where it waited" in line
    ), line


def test_progress_keeps_it_quiet_and_a_new_stall_is_named_again(fresh_activity):
    activity.start_step(0, 1)
    with Heartbeat(0, timeout_s=0.3, poll_s=0.01, out=io.StringIO()) as beat:
        for it in range(2, 12):  # a phase change every 0.05 s < 0.27 s
            activity.start_step(0, it)
            time.sleep(0.05)
        assert beat.warnings == []
        activity.set_phase(activity.OPTIMIZER)
        _wait_for(lambda: beat.warnings)
        assert len(beat.warnings) == 1 and "in optimizer at iteration 11" in beat.warnings[0]
        activity.set_phase(activity.EVALUATION)
        _wait_for(lambda: len(beat.warnings) == 2)
    assert "in evaluation at iteration 11" in beat.warnings[1]


def test_start_up_is_left_out(fresh_activity):
    """Waiting for another rank to prepare data uses a longer timeout than the collectives."""
    with Heartbeat(0, timeout_s=0.05, poll_s=0.01, out=io.StringIO()) as beat:
        time.sleep(0.3)
    assert beat.warnings == []
