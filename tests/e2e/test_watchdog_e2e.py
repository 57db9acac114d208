"""A worker aborted by NCCL's watchdog (SIGABRT, no Python error) is named with its phase and
iteration, and the rank it waited for is named first (ptdp.run.launch + ptdp.run.postmortem);
simulated on CPU with os.abort() after the timeout."""

from __future__ import annotations

import pytest

from helpers.watchdog_worker import simulated_watchdog_worker
from ptdp.run.launch import WorkerFailedError, launch_workers

TIMEOUT_S = 2.0


def test_a_watchdog_abort_names_the_stalled_rank_and_where_the_aborted_one_waited():
    with pytest.raises(WorkerFailedError) as info:
        launch_workers(simulated_watchdog_worker, 2, TIMEOUT_S, collective_timeout_s=TIMEOUT_S)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("worker rank 1 (local rank 1, pid "), lines
    assert ") failed first, in forward at iteration 3: made no progress for " in lines[0], lines
    assert "before NCCL's watchdog aborted rank 0 (a collective timed out waiting for it" in lines[0], lines
    assert (
        "the other ranks' errors follow from it: rank 0 was aborted by NCCL's watchdog (a collective timed out)"
        in lines
    ), lines
    aborted = "  (rank 0 was aborted by NCCL's watchdog (SIGABRT) "
    where = " after entering its last phase, in gradient sync at iteration 3)"
    assert any(line.startswith(aborted) and line.endswith(where) for line in lines), lines


def test_without_the_timeout_an_abort_is_a_fatal_signal_of_its_own():
    """The same records read without a timeout: rank 0 died of SIGABRT first, in gradient sync at
    iteration 3 (a crash of its own, as before)."""
    with pytest.raises(WorkerFailedError) as info:
        launch_workers(simulated_watchdog_worker, 2, 0.5)
    first = str(info.value).splitlines()[0]
    assert first.startswith("worker rank 0 (local rank 0, pid ") and (
        ") failed first, in gradient sync at iteration 3: died of a fatal signal (Aborted)" in first
    ), first
