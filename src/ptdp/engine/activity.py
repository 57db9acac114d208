"""What this process is doing, for error messages: its rank, the training phase and the iteration.

:mod:`ptdp.engine.comm` turns a failed or timed-out collective (gloo: "Timed out waiting ...")
into a :class:`CollectiveError` saying the rank, phase, iteration, axis, operation, the ranks
waited for and, after a timeout, which of them reported none themselves (``comm._silent_ranks``).
The record (:data:`CURRENT`) is updated with plain attribute writes (no I/O, no communication).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ptdp.engine.hooks import PHASE_HOOKS

START_UP = "start-up"
FORWARD = "forward"
BACKWARD = "backward"
PIPELINE = "pipeline send/recv"
GRAD_SYNC = "gradient sync"
OPTIMIZER = "optimizer"
EVALUATION = "evaluation"
CHECKPOINT = "checkpoint"
#: a zero-bubble schedule's input-gradient (B) and weight-gradient (W) passes
BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"
PHASES = (
    START_UP,
    FORWARD,
    BACKWARD,
    PIPELINE,
    GRAD_SYNC,
    OPTIMIZER,
    EVALUATION,
    CHECKPOINT,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
)
_PHASE_INDEX = {phase: i for i, phase in enumerate(PHASES)}


class Activity:
    """This process's global rank, current phase and 1-based iteration (None before the first)."""

    __slots__ = ("rank", "phase", "iteration", "changes")

    def __init__(self) -> None:
        self.rank: int | None = None
        self.phase = START_UP
        self.iteration: int | None = None
        self.changes = 0
        """Phase changes so far: a heartbeat (:mod:`ptdp.run.heartbeat`) sees progress when it grows."""

    def where(self) -> str:
        at = f" at iteration {self.iteration}" if self.iteration is not None else " before the first iteration"
        return f"in {self.phase}{at}"


CURRENT = Activity()
"""The record of this process."""
_mirror = None  # a ptdp.run.rank_records.ActivityBox while a launched worker runs


def mirror_to(box) -> None:
    """Also write every phase change into ``box`` (``write(phase_index, iteration)``; a
    memory-mapped record that outlives the process, :mod:`ptdp.run.postmortem`), or stop (None)."""
    global _mirror
    _mirror = box
    if box is not None:
        box.write(phase_index(), CURRENT.iteration)


def phase_index() -> int:
    """The index of the current phase in :data:`PHASES`."""
    return _PHASE_INDEX.get(CURRENT.phase, 0)


def start_step(rank: int, iteration: int) -> None:
    """A training step begins: ``iteration`` is 1-based, as in the logs."""
    CURRENT.rank, CURRENT.iteration = rank, iteration
    set_phase(FORWARD)


def set_phase(phase: str, iteration: int | None = None) -> None:
    """Enter ``phase`` (one of :data:`PHASES`); ``iteration`` replaces the current one if given.
    Then the registered :data:`ptdp.engine.hooks.PHASE_HOOKS` run."""
    CURRENT.phase = phase
    CURRENT.changes += 1
    if iteration is not None:
        CURRENT.iteration = iteration
    if _mirror is not None:
        _mirror.write(_PHASE_INDEX[phase], CURRENT.iteration)
    for hook in PHASE_HOOKS:
        hook(CURRENT.rank, CURRENT.iteration, phase)


class CollectiveError(RuntimeError):
    """A collective or point-to-point transfer failed on this rank: a peer stopped responding
    (:class:`CollectiveTimeout`) or went away. ``rank``, ``phase`` and ``iteration`` say where."""

    def __init__(self, message: str, *, rank: int, phase: str, iteration: int | None) -> None:
        super().__init__(message)
        self.rank, self.phase, self.iteration = rank, phase, iteration


class CollectiveTimeout(CollectiveError):
    """A collective or transfer did not complete within the process group's timeout."""


_GLOO_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


def is_timeout(err: BaseException) -> bool:
    """Whether a backend error says an operation timed out (gloo: "Timed out waiting ...",
    "Application timeout caused pair closure")."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def collective_error(
    err: BaseException,
    *,
    rank: int,
    axis: str,
    op: str,
    ranks: tuple[int, ...],
    peer: int | None = None,
    timeout_s: float | None = None,
    silent: list[int] | None = None,
) -> CollectiveError:
    """The :class:`CollectiveError` for ``err`` raised by ``op`` on ``axis`` (global ``ranks`` of
    the group; ``peer``: the other rank of a send or recv), worded with :data:`CURRENT`.
    ``silent``: after a timeout, the ranks that did not report one too (the likely culprits)."""
    if peer is not None:
        what = f"{axis} {op} {'from' if op == 'recv' else 'to'} rank {peer}"
    else:
        what = f"{axis} {op} over ranks {', '.join(map(str, ranks))}"
    text = str(err).strip()
    detail = _GLOO_PREFIX.sub("", text.splitlines()[0] if text else type(err).__name__)
    where = CURRENT.where()
    phase, iteration = CURRENT.phase, CURRENT.iteration
    if not is_timeout(err):
        return CollectiveError(
            f"rank {rank} failed {where}: {what}: {detail.split('. ')[0]}", rank=rank, phase=phase, iteration=iteration
        )
    after = f" after {timeout_s / 60:g} min" if timeout_s else ""
    if silent:
        many = len(silent) > 1
        why = (
            f"rank{'s' if many else ''} {', '.join(map(str, silent))} reported no timeout of "
            f"{'their' if many else 'its'} own: likely the one{'s' if many else ''} that stopped responding"
        )
    else:
        why = "a rank it waits for stopped responding, or is much slower"
    return CollectiveTimeout(
        f"rank {rank} timed out{after} {where}: {what} did not complete ({why}; "
        f"--distributed-timeout-minutes sets the limit)",
        rank=rank,
        phase=phase,
        iteration=iteration,
    )


_RECOMPUTING: ContextVar[bool] = ContextVar("ptdp_recomputing", default=False)


def is_recomputing() -> bool:
    """Whether the code running is a recomputation in backward
    (:func:`ptdp.engine.model.recompute.recomputed`): what a layer counts once per micro-batch (an
    MoE layer's expert loads) it must not count again."""
    return _RECOMPUTING.get()


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the code inside as a recomputation (:func:`is_recomputing`)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
