"""A worker process leaves its phase and how it ended; ``ptdp train`` names the rank that failed
first (the diagnosis from records: tests/unit/test_postmortem.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import budget, faults
from helpers.cli import TINY
from helpers.proc_helpers import run_together
from ptdp.run import rank_records

RECORDING = textwrap.dedent("""
    import os, signal, sys, time
    from ptdp.engine import activity
    from ptdp.run import postmortem, rank_records
    with rank_records.recording(2, 0):
        activity.start_step(2, 5)
        activity.set_phase(activity.BACKWARD)
        how = sys.argv[1]
        if how == "abort":
            os.abort()
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":
            raise ValueError("bad thing")
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize(
    "how, kind, summary",
    [
        ("raise", "raised", "ValueError: bad thing"),
        ("abort", "signal", "died of a fatal signal (Aborted)"),
        ("kill", "silent", "was killed without a trace"),
        ("term", "sigterm", "received SIGTERM"),
    ],
)
def test_a_worker_leaves_its_phase_and_how_it_ended(tmp_path, how, kind, summary):
    env = dict(os.environ, **{rank_records.DIR_ENV: str(tmp_path)})
    proc = subprocess.Popen([sys.executable, "-c", RECORDING, how], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if how == "term":
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=budget.seconds(60))
    finally:
        proc.kill()
        proc.wait()
    end = rank_records.read_rank_end(rank_records.attempt_dir(tmp_path, 0), 2)
    assert (end.kind, end.phase, end.iteration) == (kind, "backward", 5)
    assert end.summary.startswith(summary), end.summary
    assert end.pid == proc.pid


@pytest.mark.slow
def test_ptdp_train_names_the_rank_that_raised_first(corpus, tmp_path):
    """tp2 pp1 dp2: rank 3 raises in backward at iteration 2; its peers then fail in collectives and
    the launcher may poll any of them first. The message names rank 3, its error and phase, and
    says the others follow from it; the launcher's own traceback stays off the terminal."""
    env = faults.environment(
        os.environ,
        PTDP_CACHE_DIR=str(tmp_path / "cache"),
        OMP_NUM_THREADS="1",
        **{faults.CRASH_ENV: "3:2:backward:raise"},
    )
    cmd = [
        sys.executable,
        "-m",
        "ptdp.cli",
        "train",
        *TINY,
        "--tp",
        "2",
        "--pp",
        "1",
        "--dp",
        "2",
        "--data",
        str(corpus / "docs"),
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    [proc] = run_together([cmd], env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "ptdp train: error: worker rank 3 (local rank 3, pid " in proc.stderr
        and ") failed first, in backward at iteration 2: RuntimeError: ptdp test crash: rank 3 in backward at "
        "iteration 2"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "the other ranks' errors follow from it: " in proc.stderr
    assert "no restarts allowed (--max-restarts 0)" in proc.stderr
    assert "torch.multiprocessing.spawn.ProcessRaisedException" not in proc.stderr
