"""A two-rank job that ends as an NCCL watchdog timeout does, on CPU (tests/e2e/test_watchdog_e2e.py):
rank 1 stops responding in forward at iteration 3; rank 0 waits in gradient sync for the
process-group timeout and is then aborted (SIGABRT), as NCCL's watchdog aborts a process whose
collective timed out."""

from __future__ import annotations

import os
import time

from ptdp.engine import activity
from ptdp.run import rank_records


def simulated_watchdog_worker(timeout_s: float) -> dict:
    rank = int(os.environ["RANK"])
    with rank_records.recording(rank, 0):
        activity.start_step(rank, 3)
        if rank == 1:
            time.sleep(600)  # stops responding; the launcher stops it after rank 0's abort
        activity.set_phase(activity.GRAD_SYNC)
        time.sleep(timeout_s)  # the collective waits for rank 1 until the timeout
        os.abort()  # what the watchdog does then
    return {}
