"""The rank that failed first is named, with how and where, and the others' errors are said to
follow from it (ptdp.run.postmortem), whichever worker the launcher happened to poll first."""

from __future__ import annotations

import json
import os

from ptdp.run import postmortem, rank_records


def _box(folder, rank, phase_index, iteration, state=rank_records.RUNNING):
    box = rank_records.ActivityBox(folder / f"rank{rank}.activity")
    box.write(phase_index, iteration, state)


def _error(folder, rank, t, kind, message, consequence, phase="backward", iteration=2):
    record = {
        "time_ns": t,
        "type": kind,
        "message": message,
        "consequence": consequence,
        "phase": phase,
        "iteration": iteration,
        "traceback": f"Traceback (most recent call last):\n  File x\n{kind}: {message}\n",
    }
    (folder / f"rank{rank}.error.json").write_text(json.dumps(record))


def _sigterm(folder, rank, t):
    path = folder / f"rank{rank}.signal"
    path.write_text('Current thread 0x1 (most recent call first):\n  File "x", line 1 in f\n')
    os.utime(path, ns=(t, t))


def test_an_error_of_its_own_wins_over_earlier_collective_errors_and_sigterms(tmp_path):
    for r in range(4):
        _box(tmp_path, r, 2, 2)
    lost = "rank 0 failed in backward at iteration 2: tp all_gather over ranks 0, 1, 2, 3: Connection closed by peer"
    _error(tmp_path, 3, 2_000, "RuntimeError", "cannot reshape tensor of 0 elements", False)
    _error(tmp_path, 0, 1_000, "CollectiveError", lost, True)  # an earlier clock is no reason to blame it
    _sigterm(tmp_path, 1, 3_000)
    _sigterm(tmp_path, 2, 3_000)
    d = postmortem.diagnose(tmp_path, 4)
    assert d.first.rank == 3 and d.first.kind == "raised"
    text = d.message(head="worker rank 3 (local rank 3, pid 7)", exit_text="exited with code 1")
    lines = text.splitlines()
    assert lines[0] == (
        "worker rank 3 (local rank 3, pid 7) failed first, in backward at iteration 2: "
        "RuntimeError: cannot reshape tensor of 0 elements (exited with code 1)"
    )
    assert "  RuntimeError: cannot reshape tensor of 0 elements" in lines
    assert (
        "the other ranks' errors follow from it: rank 0 failed in a collective with it; ranks 1, 2 were "
        "stopped by the launcher"
    ) in lines
    assert f"  (e.g. {lost})" in lines


def test_a_rank_that_left_no_trace_is_the_one_that_died(tmp_path):
    """SIGKILL (the out-of-memory killer): no error, no signal record; its phase is still known."""
    for r in range(3):
        _box(tmp_path, r, 1, 5)
    _error(tmp_path, 0, 1_000, "CollectiveError", "rank 0 failed in forward at iteration 5: ...", True)
    _sigterm(tmp_path, 2, 2_000)
    d = postmortem.diagnose(tmp_path, 3)
    assert (d.first.rank, d.first.kind, d.first.phase, d.first.iteration) == (1, "silent", "forward", 5)
    assert d.message(exit_text="was killed by signal SIGKILL (exit code -9)").splitlines()[0] == (
        "worker rank 1 failed first, in forward at iteration 5: was killed by signal SIGKILL (exit code -9)"
    )
    assert "SIGKILL" in d.message().splitlines()[0]


def test_a_stall_names_the_first_timeout_whose_message_names_the_stalled_rank(tmp_path):
    for r in range(3):
        _box(tmp_path, r, 4, 2)
    timeout = (
        "rank {} timed out after 0.1 min in gradient sync at iteration 2: dp all_reduce over ranks 0, 1 did "
        "not complete (rank 1 reported no timeout of its own: likely the one that stopped responding)"
    )
    _error(tmp_path, 2, 1_500, "CollectiveTimeout", timeout.format(2), True, "gradient sync")
    _error(tmp_path, 0, 1_000, "CollectiveTimeout", timeout.format(0), True, "gradient sync")
    _sigterm(tmp_path, 1, 2_000)  # the stalled rank, stopped by the launcher afterwards
    d = postmortem.diagnose(tmp_path, 3)
    assert (d.first.rank, d.first.kind) == (0, "collective")
    lines = d.message().splitlines()
    assert lines[0] == "worker rank 0 failed first, in gradient sync at iteration 2: CollectiveTimeout"
    assert lines[1] == timeout.format(0)
    assert lines[2] == (
        "the other ranks' errors follow from it: rank 2 failed in a collective with it; "
        "rank 1 was stopped by the launcher"
    )


def test_no_records_no_diagnosis(tmp_path):
    assert postmortem.diagnose(tmp_path / "missing", 2) is None
    assert postmortem.diagnose(tmp_path, 2) is None
