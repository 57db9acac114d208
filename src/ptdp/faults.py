"""Test-only fault injection, switched on by environment variables. Never set them in a real run.

``PTDP_TEST_NAN_LOSS="RANK:ITERS"``
    ``ITERS`` is ``every`` or comma-separated 1-based iterations. At those iterations the first
    forward output of global rank ``RANK`` (its loss on a last pipeline stage, else the activation
    it passes on) is multiplied by NaN, so the step's loss and gradients become non-finite.
``PTDP_TEST_STALL="RANK:ITER:PHASE[:SECONDS]"``
    Global rank ``RANK`` sleeps ``SECONDS`` (default 3600) when it enters ``PHASE`` (a phase of
    :mod:`ptdp.activity`, e.g. ``gradient sync``) at 1-based iteration ``ITER``, before that
    phase's communication: a worker that stops responding. It prints one line first:
    ``ptdp test stall: rank R sleeps in PHASE at iteration I from <time.time()>``.

The variables are read once per step (parsed once per value); without them nothing happens.
"""

from __future__ import annotations

import functools
import os
import sys
import time

NAN_LOSS_ENV = "PTDP_TEST_NAN_LOSS"
STALL_ENV = "PTDP_TEST_STALL"


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
