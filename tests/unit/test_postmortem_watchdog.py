"""Reading NCCL watchdog aborts from the workers' records (ptdp.run.postmortem.diagnose with the
process-group timeout): an abort after waiting most of the timeout, or while another rank had made
no progress that long, follows from the rank that made no progress the longest; a short-lived
abort with every rank progressing is a crash of its own."""

from __future__ import annotations

import os

from ptdp.engine.activity import PHASES
from ptdp.run import postmortem, rank_records

MIN = 60_000_000_000  # ns
T0 = 1_800_000_000 * 1_000_000_000  # some wall-clock time, ns


def _box(folder, rank, phase, iteration, since_ns):
    rank_records.ActivityBox(folder / f"rank{rank}.activity").write(PHASES.index(phase), iteration, since_ns=since_ns)


def _signal(folder, rank, at_ns, aborted: bool):
    path = folder / f"rank{rank}.signal"
    head = "Fatal Python error: Aborted\n\n" if aborted else ""
    path.write_text(head + 'Current thread 0x1 (most recent call first):\n  File "x", line 1 in f\n')
    os.utime(path, ns=(at_ns, at_ns))


def test_the_rank_the_aborted_ones_waited_for_is_named_first(tmp_path):
    _box(tmp_path, 0, "gradient sync", 7, T0)
    _box(tmp_path, 2, "gradient sync", 7, T0 + MIN // 60)
    _box(tmp_path, 1, "forward", 7, T0 - MIN // 2)  # stuck since before the others waited
    _box(tmp_path, 3, "pipeline send/recv", 7, T0 + MIN // 30)
    _signal(tmp_path, 0, T0 + 10 * MIN, aborted=True)  # 10 min: the watchdog's timeout
    _signal(tmp_path, 2, T0 + 10 * MIN + MIN // 60, aborted=True)
    _signal(tmp_path, 1, T0 + 10 * MIN + MIN // 30, aborted=False)  # SIGTERM from the launcher
    _signal(tmp_path, 3, T0 + 10 * MIN + MIN // 30, aborted=False)
    d = postmortem.diagnose(tmp_path, 4, timeout_s=600)
    assert (d.first.rank, d.first.kind, d.first.phase, d.first.iteration) == (1, "stalled", "forward", 7)
    lines = d.message().splitlines()
    assert lines[0] == (
        "worker rank 1 failed first, in forward at iteration 7: made no progress for 10.5 min before "
        "NCCL's watchdog aborted ranks 0, 2 (a collective timed out waiting for it: likely the one "
        "that stopped responding; --distributed-timeout-minutes sets the limit)"
    )
    assert lines[1] == (
        "the other ranks' errors follow from it: rank 3 was stopped by the launcher; ranks 0, 2 were "
        "aborted by NCCL's watchdog (a collective timed out)"
    )
    assert (
        "  (rank 0 was aborted by NCCL's watchdog (SIGABRT) 10.0 min after entering its last phase, in gradient "
        "sync at iteration 7)" in lines
    )


def test_every_rank_aborted_names_the_first_abort_with_its_phase(tmp_path):
    for rank in range(2):
        _box(tmp_path, rank, "backward", 4, T0)
        _signal(tmp_path, rank, T0 + 10 * MIN + rank, aborted=True)
    d = postmortem.diagnose(tmp_path, 2, timeout_s=600)
    first = d.message().splitlines()[0]
    assert first == (
        "worker rank 0 failed first, in backward at iteration 4: was aborted by NCCL's watchdog (SIGABRT) "
        "10.0 min after entering its last phase (a collective timed out; --distributed-timeout-minutes "
        "sets the limit)"
    )


def test_an_abort_well_before_the_timeout_is_a_crash_of_its_own(tmp_path):
    _box(tmp_path, 0, "optimizer", 2, T0)
    _box(tmp_path, 1, "gradient sync", 2, T0 - MIN)
    _signal(tmp_path, 0, T0 + MIN, aborted=True)  # 1 min of a 10-min timeout
    _signal(tmp_path, 1, T0 + MIN + 5, aborted=False)
    d = postmortem.diagnose(tmp_path, 2, timeout_s=600)
    assert (d.first.rank, d.first.kind) == (0, "signal")
    assert d.message().splitlines()[0] == (
        "worker rank 0 failed first, in optimizer at iteration 2: died of a fatal signal (Aborted)"
    )


def test_a_host_that_ran_ahead_of_its_collective_is_still_a_watchdog_abort(tmp_path):
    """On a GPU the host enqueues the collective and goes on: rank 0 blocked in the optimizer only
    2 min before its abort, but rank 1 had made no progress for 11 min by then."""
    _box(tmp_path, 0, "optimizer", 5, T0 + 8 * MIN)
    _box(tmp_path, 1, "backward", 5, T0 - MIN)
    _signal(tmp_path, 0, T0 + 10 * MIN, aborted=True)
    _signal(tmp_path, 1, T0 + 10 * MIN + 5, aborted=False)
    d = postmortem.diagnose(tmp_path, 2, timeout_s=600)
    assert (d.first.rank, d.first.kind, d.first.phase, d.first.iteration) == (1, "stalled", "backward", 5)
    assert (
        "  (rank 0 was aborted by NCCL's watchdog (SIGABRT) 2.0 min after entering its last phase, in optimizer "
        "at iteration 5)" in d.message().splitlines()
    )
