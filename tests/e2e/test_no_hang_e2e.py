"""``ptdp train`` with a worker that stops responding fails within the process-group timeout (plus a
small margin), with a message naming the rank, the phase, the iteration and the stalled rank."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from helpers import faults
from helpers.cli import TINY
from helpers.proc_helpers import run_together


@pytest.mark.slow
def test_ptdp_train_with_a_stalled_worker_fails_within_the_timeout(corpus, tmp_path):
    """tp1 pp2 dp2, timeout 0.1 min: rank 1 sleeps at the start of iteration 2's gradient sync; the
    job ends within the timeout + the diagnosis grace (2 s) + 25 s for the workers and the launcher
    to exit on a busy 2-core machine, naming the stalled rank."""
    env = faults.environment(
        os.environ,
        PTDP_CACHE_DIR=str(tmp_path / "cache"),
        OMP_NUM_THREADS="1",
        **{faults.STALL_ENV: "1:2:gradient sync"},
    )
    cmd = [
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
        "2",
        "--data",
        str(corpus / "docs"),
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--distributed-timeout-minutes",
        "0.1",
    ]
    [proc] = run_together([cmd], env=env, cwd=tmp_path)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    stalled = re.search(r"ptdp test stall: rank 1 sleeps in gradient sync at iteration 2 from ([\d.]+)", proc.stderr)
    assert stalled, proc.stderr[-3000:]
    assert ended - float(stalled.group(1)) < 6 + 2 + 25, ended - float(stalled.group(1))
    assert re.search(
        r"ptdp train: error: .*\n.*rank [023] timed out after 0.1 min in gradient sync at iteration 2: "
        r".* did not complete \(rank 1 reported no timeout of its own",
        proc.stderr,
    ), proc.stderr[-3000:]
