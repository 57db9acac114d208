"""Each test's time budget: the inner timeouts of a test (worker spawns, launched commands,
subprocesses) end before the test's own pytest timeout, so a slow or hung run fails with a clear
``TimeoutError`` and its processes killed, never by pytest-timeout's kill from outside.

``conftest.py`` sets the deadline when a test's setup starts (its ``timeout`` mark, else the ini
default); :func:`seconds` gives an inner wait what is left of it, minus :data:`MARGIN_S` for
cleaning up, capped by what the caller asks for. Several waits in one test share the budget.
"""

from __future__ import annotations

import time

MARGIN_S = 15.0
"""Seconds kept back at the end of a test's budget for killing processes and reporting."""
_deadline: float | None = None


def start(timeout_s: float | None) -> None:
    """A test begins whose pytest timeout is ``timeout_s`` (None or 0: no limit)."""
    global _deadline
    _deadline = time.monotonic() + timeout_s if timeout_s else None


def seconds(requested: float | None = None) -> float:
    """How long an inner wait may last: ``requested`` (None: as long as possible), but ending
    :data:`MARGIN_S` before the test's deadline (at least 1 s)."""
    if _deadline is None:
        return requested if requested is not None else 3600.0
    left = max(1.0, _deadline - time.monotonic() - MARGIN_S)
    return left if requested is None else min(requested, left)
