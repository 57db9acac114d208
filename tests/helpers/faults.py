"""Fault injection for tests: a :class:`FaultPlan` installed as engine hooks
(:mod:`ptdp.engine.hooks`), in this process (:func:`install`) or in the worker processes a test
launches (:func:`environment`: the variables below plus ``fault_site/`` on ``PYTHONPATH``, whose
``sitecustomize`` installs the plan the variables describe at interpreter start-up).

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
``PTDP_TEST_KILL_AT_ITERATION=K`` (with ``PTDP_TEST_KILL_RANK``, default 1)
    That global rank of the job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) sends itself
    SIGKILL when iteration K+1 starts (after iteration K's evaluation and checkpoint), as a crashed
    machine would (restart tests).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ptdp.engine import hooks
from ptdp.engine.activity import FORWARD, PHASES

NAN_LOSS_ENV = "PTDP_TEST_NAN_LOSS"
STALL_ENV = "PTDP_TEST_STALL"
CRASH_ENV = "PTDP_TEST_CRASH"
KILL_AT_ITERATION_ENV = "PTDP_TEST_KILL_AT_ITERATION"
KILL_RANK_ENV = "PTDP_TEST_KILL_RANK"
CRASH_KINDS = ("raise", "abort", "kill")
SITE_DIR = Path(__file__).resolve().parent / "fault_site"
"""The folder whose ``sitecustomize`` installs the plan of the environment in a new process."""


@dataclass(frozen=True)
class FaultPlan:
    """Which rank fails how, and when (1-based iterations). Each part None: not planned."""

    nan_loss: tuple[int, frozenset[int] | None] | None = None
    """(rank, iterations or None for every one) whose first forward output becomes NaN."""
    stall: tuple[int, int, str, float] | None = None
    """(rank, iteration, phase, seconds) of a sleep on entering the phase."""
    crash: tuple[int, int, str, str] | None = None
    """(rank, iteration, phase, how) of a crash on entering the phase."""
    kill_at: tuple[int, int] | None = None
    """(iteration, rank) after which that rank sends itself SIGKILL (first attempt only)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan the test variables describe, or None when none is set. Raises ValueError for
        a malformed value (naming the variable and the expected form)."""
        env = os.environ if env is None else env
        nan, stall, crash, kill = (
            env.get(name) for name in (NAN_LOSS_ENV, STALL_ENV, CRASH_ENV, KILL_AT_ITERATION_ENV)
        )
        if not (nan or stall or crash or kill):
            return None
        return cls(
            nan_loss=parse_nan_loss(nan) if nan else None,
            stall=parse_stall(stall) if stall else None,
            crash=parse_crash(crash) if crash else None,
            kill_at=(int(kill), int(env.get(KILL_RANK_ENV, "1"))) if kill else None,
        )

    def poisons(self, rank: int, iteration: int) -> bool:
        """Whether ``rank`` makes its first forward output NaN at ``iteration``."""
        if self.nan_loss is None:
            return False
        target, iters = self.nan_loss
        return rank == target and (iters is None or iteration in iters)

    def stall_phase(self, rank: int, iteration: int) -> str | None:
        return self.stall[2] if self.stall is not None and self.stall[:2] == (rank, iteration) else None

    def crash_phase(self, rank: int, iteration: int) -> str | None:
        return self.crash[2] if self.crash is not None and self.crash[:2] == (rank, iteration) else None

    def do_stall(self, rank: int | None, iteration: int | None, phase: str) -> None:
        if self.stall is None:
            return
        print(
            f"ptdp test stall: rank {rank} sleeps in {phase} at iteration {iteration} from {time.time():.3f}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(self.stall[3])

    def do_crash(self, rank: int | None, iteration: int | None, phase: str) -> None:
        if self.crash is None:
            return
        how = self.crash[3]
        if how == "raise":
            raise RuntimeError(f"ptdp test crash: rank {rank} in {phase} at iteration {iteration}")
        if how == "abort":
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_after(self, iteration: int, rank: int, restart: int) -> None:
        """SIGKILL this process after ``iteration`` if planned (first attempt of the job only)."""
        if self.kill_at == (iteration, rank) and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def install(plan: FaultPlan | None, restart: int | None = None) -> Callable[[], None]:
    """Register ``plan``'s hooks in this process (nothing for None); returns their remover.
    ``restart``: the launcher's restart count, for :meth:`FaultPlan.kill_after` (None: read from
    ``TORCHELASTIC_RESTART_COUNT`` then, which a launched function sets after start-up)."""
    if plan is None:
        return lambda: None
    fired: set[tuple[str, int | None]] = set()  # each stall and crash once per iteration

    def on_phase(rank: int | None, iteration: int | None, phase: str) -> None:
        if rank is None or iteration is None:
            return
        if plan.stall_phase(rank, iteration) == phase and ("stall", iteration) not in fired:
            fired.add(("stall", iteration))
            plan.do_stall(rank, iteration, phase)
        if plan.crash_phase(rank, iteration) == phase and ("crash", iteration) not in fired:
            fired.add(("crash", iteration))
            plan.do_crash(rank, iteration, phase)
        if phase == FORWARD and iteration > 1 and plan.kill_at is not None:
            count = restart if restart is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            plan.kill_after(iteration - 1, rank, count)

    def on_step(rank: int, iteration: int, module) -> Callable[[], None] | None:
        return poison_first_forward(module).remove if plan.poisons(rank, iteration) else None

    hooks.PHASE_HOOKS.append(on_phase)
    hooks.STEP_HOOKS.append(on_step)

    def remove() -> None:
        hooks.PHASE_HOOKS.remove(on_phase)
        hooks.STEP_HOOKS.remove(on_step)

    return remove


def install_from_env() -> None:
    """Install the plan of this process's environment (what ``fault_site/sitecustomize`` runs)."""
    install(FaultPlan.from_env())


def environment(base: Mapping[str, str], **variables: str) -> dict[str, str]:
    """``base`` plus the fault ``variables`` (by their names above), with :data:`SITE_DIR` and the
    tests folder first on ``PYTHONPATH`` so that every process started with it installs them."""
    path = [str(SITE_DIR), str(SITE_DIR.parents[1])]
    if base.get("PYTHONPATH"):
        path.append(base["PYTHONPATH"])
    return dict(base, **variables, PYTHONPATH=os.pathsep.join(path))


def parse_nan_loss(text: str) -> tuple[int, frozenset[int] | None]:
    try:
        rank, iters = text.split(":")
        return int(rank), None if iters.strip() == "every" else frozenset(int(i) for i in iters.split(","))
    except ValueError:
        raise ValueError(f'{NAN_LOSS_ENV}={text!r}: expected "RANK:ITER,ITER,..." or "RANK:every"') from None


def parse_stall(text: str) -> tuple[int, int, str, float]:
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        plan = int(parts[0]), int(parts[1]), parts[2], float(parts[3]) if len(parts) == 4 else 3600.0
    except ValueError:
        raise ValueError(f'{STALL_ENV}={text!r}: expected "RANK:ITER:PHASE" or "RANK:ITER:PHASE:SECONDS"') from None
    if plan[2] not in PHASES:
        raise ValueError(f"{STALL_ENV}: phase {plan[2]!r} is not one of {PHASES}")
    return plan


def parse_crash(text: str) -> tuple[int, int, str, str]:
    parts = text.split(":")
    try:
        if len(parts) != 4 or parts[3] not in CRASH_KINDS:
            raise ValueError
        plan = int(parts[0]), int(parts[1]), parts[2], parts[3]
    except ValueError:
        raise ValueError(
            f'{CRASH_ENV}={text!r}: expected "RANK:ITER:PHASE:HOW" with HOW one of {CRASH_KINDS}'
        ) from None
    if plan[2] not in PHASES:
        raise ValueError(f"{CRASH_ENV}: phase {plan[2]!r} is not one of {PHASES}")
    return plan


def poison_first_forward(module):
    """Make ``module``'s next forward output NaN (once); returns the hook handle."""

    def hook(_module, _args, output):
        handle.remove()
        return output * float("nan")

    handle = module.register_forward_hook(hook)
    return handle
