"""A worker's own last words before NCCL's watchdog aborts it: where it was waiting.

On NCCL a collective past the process-group timeout raises nothing in Python: the watchdog thread
aborts the process (SIGABRT). So a worker on NCCL runs a :class:`Heartbeat`, a daemon thread that
reads :data:`ptdp.engine.activity.CURRENT` every ``poll_s`` seconds and, after no phase change for
:data:`WARN_FRACTION` of the timeout, prints one line to stderr::

    ptdp: rank 3 has made no progress for 9.0 min in gradient sync at iteration 7 (90% of the
    process-group timeout, 10 min): if NCCL's watchdog aborts this process, this is where it waited

Start-up is left out. :func:`enable_fatal_signal_stacks` has faulthandler print every thread's
stack on SIGABRT when no postmortem folder records it.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from typing import TextIO

from ptdp.engine import activity

WARN_FRACTION = 0.9
"""Share of the process-group timeout without progress after which the heartbeat speaks."""


class Heartbeat:
    """Watches this process's activity record from a daemon thread (see module docstring).

    Args:
        rank: the global rank, for the message.
        timeout_s: the process-group timeout in seconds (``--distributed-timeout-minutes``).
        poll_s: how often the record is read.
        out: where the line goes (default stderr).
    """

    def __init__(self, rank: int, timeout_s: float, *, poll_s: float = 1.0, out: TextIO | None = None) -> None:
        self.rank, self.timeout_s, self.poll_s = rank, timeout_s, poll_s
        self.out = out
        self.warnings: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptdp-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s)

    def _run(self) -> None:
        seen, since, warned = activity.CURRENT.changes, time.monotonic(), False
        while not self._stop.wait(self.poll_s):
            changes, now = activity.CURRENT.changes, time.monotonic()
            if changes != seen:
                seen, since, warned = changes, now, False
                continue
            if warned or activity.CURRENT.phase == activity.START_UP:
                continue
            if now - since >= WARN_FRACTION * self.timeout_s:
                warned = True
                self._say(now - since)

    def _say(self, idle_s: float) -> None:
        line = (
            f"ptdp: rank {self.rank} has made no progress for {idle_s / 60:.1f} min {activity.CURRENT.where()} "
            f"({WARN_FRACTION:.0%} of the process-group timeout, {self.timeout_s / 60:g} min): if NCCL's "
            f"watchdog aborts this process, this is where it waited"
        )
        self.warnings.append(line)
        print(line, file=self.out or sys.stderr, flush=True)


def enable_fatal_signal_stacks() -> None:
    """Have faulthandler print every thread's Python stack to stderr on a fatal signal (SIGABRT
    from NCCL's watchdog among them), unless it is already on (the postmortem records)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
