"""Test-only fault injection, switched on by environment variables. Never set them in a real run.

``PTDP_TEST_NAN_LOSS="RANK:ITERS"``
    ``ITERS`` is ``every`` or comma-separated 1-based iterations. At those iterations the first
    forward output of global rank ``RANK`` (its loss on a last pipeline stage, else the activation
    it passes on) is multiplied by NaN, so the step's loss and gradients become non-finite.
``PTDP_TEST_STALL="RANK:ITER:PHASE[:SECONDS]"``
    Global rank ``RANK`` sleeps ``SECONDS`` (default 3600) when it enters ``PHASE`` (a phase of
    :mod:`ptdp.engine.activity`, e.g. ``gradient sync``) at 1-based iteration ``ITER``, before that
    phase's communication: a worker that stops responding. It prints one line first:
    ``ptdp test stall: rank R sleeps in PHASE at iteration I from <time.time()>``.

``PTDP_TEST_CRASH="RANK:ITER:PHASE:HOW"``
    Global rank ``RANK`` fails when it enters ``PHASE`` at 1-based iteration ``ITER``: ``raise``
    raises ``RuntimeError("ptdp test crash ...")``, ``abort`` calls ``os.abort()`` (SIGABRT, a
    fatal signal), ``kill`` sends itself SIGKILL (no trace at all).

The variables are read once per step (parsed once per value); without them nothing happens.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

NAN_LOSS_ENV = "PTDP_TEST_NAN_LOSS"
STALL_ENV = "PTDP_TEST_STALL"
CRASH_ENV = "PTDP_TEST_CRASH"
CRASH_KINDS = ("raise", "abort", "kill")


@functools.cache
def _nan_plan(text: str) -> tuple[int, frozenset[int] | None]:
    try:
        rank, iters = text.split(":")
        return int(rank), None if iters.strip() == "every" else frozenset(int(i) for i in iters.split(","))
    except ValueError:
        raise ValueError(f'{NAN_LOSS_ENV}={text!r}: expected "RANK:ITER,ITER,..." or "RANK:every"') from None


def nan_loss(rank: int, iteration: int) -> bool:
    """Whether rank ``rank`` poisons its forward at 1-based ``iteration`` (``PTDP_TEST_NAN_LOSS``)."""
    text = os.environ.get(NAN_LOSS_ENV)
    if not text:
        return False
    target, iters = _nan_plan(text)
    return rank == target and (iters is None or iteration in iters)


def poison_first_forward(module):
    """Make ``module``'s next forward output NaN (once); returns the hook handle."""
    def hook(_module, _args, output):
        handle.remove()
        return output * float("nan")

    handle = module.register_forward_hook(hook)
    return handle


@functools.cache
def _stall_plan(text: str) -> tuple[int, int, str, float]:
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        return int(parts[0]), int(parts[1]), parts[2], float(parts[3]) if len(parts) == 4 else 3600.0
    except ValueError:
        raise ValueError(f'{STALL_ENV}={text!r}: expected "RANK:ITER:PHASE" or "RANK:ITER:PHASE:SECONDS"') from None


def stall_phase(rank: int, iteration: int) -> str | None:
    """The phase rank ``rank`` stalls in at 1-based ``iteration`` (``PTDP_TEST_STALL``), or None."""
    text = os.environ.get(STALL_ENV)
    if not text:
        return None
    target, at, phase, _ = _stall_plan(text)
    return phase if (rank, iteration) == (target, at) else None


def stall(rank: int, iteration: int, phase: str) -> None:
    seconds = _stall_plan(os.environ[STALL_ENV])[3]
    print(f"ptdp test stall: rank {rank} sleeps in {phase} at iteration {iteration} from {time.time():.3f}",
          file=sys.stderr, flush=True)
    time.sleep(seconds)


@functools.cache
def _crash_plan(text: str) -> tuple[int, int, str, str]:
    parts = text.split(":")
    try:
        if len(parts) != 4 or parts[3] not in CRASH_KINDS:
            raise ValueError
        return int(parts[0]), int(parts[1]), parts[2], parts[3]
    except ValueError:
        raise ValueError(f'{CRASH_ENV}={text!r}: expected "RANK:ITER:PHASE:HOW" with HOW one of {CRASH_KINDS}') from None


def crash_phase(rank: int, iteration: int) -> str | None:
    """The phase rank ``rank`` crashes in at 1-based ``iteration`` (``PTDP_TEST_CRASH``), or None."""
    text = os.environ.get(CRASH_ENV)
    if not text:
        return None
    target, at, phase, _ = _crash_plan(text)
    return phase if (rank, iteration) == (target, at) else None


def crash(rank: int, iteration: int, phase: str) -> None:
    how = _crash_plan(os.environ[CRASH_ENV])[3]
    if how == "raise":
        raise RuntimeError(f"ptdp test crash: rank {rank} in {phase} at iteration {iteration}")
    if how == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)
