"""Which worker failed first, how, and where: the records each worker leaves, and their reading.

When one worker of a job dies, its peers fail a moment later in a collective ("Connection closed
by peer", or a timeout), and the launcher stops the rest. PyTorch's launcher then reports the
first failed process it happens to poll, often a healthy peer, and a worker killed by a signal
leaves no Python traceback at all. So each worker started by ``ptdp train`` leaves, in a folder
the launcher names (:data:`DIR_ENV`, one sub-folder per attempt), three small records:

- ``rank<R>.activity``: a 64-byte memory-mapped file holding the rank's current phase and
  iteration and when it entered that phase (:mod:`ptdp.engine.activity` writes it on every phase
  change: a memory store and the vDSO clock, no system call), so the last phase survives even a
  SIGKILL;
- ``rank<R>.error.json``: written when the worker raises: the exception, its traceback, the time
  (ns) and whether it is a consequence of a peer's failure (a
  :class:`~ptdp.engine.activity.CollectiveError`);
- ``rank<R>.signal``: Python's ``faulthandler`` output when the worker receives a fatal signal
  (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) or SIGTERM, written from the signal handler itself,
  so also while the worker is blocked inside a collective; its modification time is when.

:func:`diagnose` reads them after the launcher gave up and names the rank that failed first: the
earliest worker that raised an error of its own or died of a fatal signal; else one that left no
record at all (killed by SIGKILL, e.g. by the out-of-memory killer); else the first collective
error (a timeout names the rank that stopped responding). The other ranks' failures are said to
follow from it. Without the folder (torchrun, tests) nothing is recorded.

On NCCL a collective that times out raises nothing: the watchdog thread aborts the process
(SIGABRT, recorded by faulthandler as "Aborted"). Given the process-group timeout, a rank that
aborted after at least :data:`WATCHDOG_FRACTION` of it in one phase, or while another rank had
made no progress for that long, is read as such a watchdog abort, not as a failure of its own
(:func:`watchdog_aborts`): then the rank named first is the one, among those that were not
aborted, that made no progress for the longest time (the one the others waited for), and the
aborted ranks are said to follow from it with their phase and iteration. On a GPU that phase is
where the host was when it blocked, which may come after the collective that timed out (the host
enqueues collectives and runs ahead); NCCL's flight-recorder dump names the collective.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import mmap
import os
import signal
import struct
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "PTDP_POSTMORTEM_DIR"
"""The folder of the records; set by ``ptdp train``'s launcher for its workers."""
_BOX_FORMAT = "<4sBBxxqqq"  # magic, phase index, state, iteration (-1: none), pid, since (time.time_ns())
_BOX_SIZE = 64
_MAGIC = b"ptdp"
RUNNING, FINISHED, RAISED = 0, 1, 2
_FATAL = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
WATCHDOG_FRACTION = 0.9
"""Share of the process-group timeout that tells an NCCL watchdog abort (:func:`watchdog_aborts`)."""


def attempt_dir(root: str | Path, attempt: int) -> Path:
    """The records of one attempt of a job (the launcher's restarts count attempts from 0)."""
    return Path(root) / f"attempt_{attempt}"


class ActivityBox:
    """This rank's phase and iteration mirrored into a memory-mapped file (see module docstring)."""

    def __init__(self, path: Path) -> None:
        with open(path, "w+b") as f:
            f.truncate(_BOX_SIZE)
            self._map = mmap.mmap(f.fileno(), _BOX_SIZE)
        self.write(0, None, RUNNING)

    def write(self, phase_index: int, iteration: int | None, state: int = RUNNING, since_ns: int | None = None) -> None:
        """Record the phase, iteration and state, and ``since_ns`` (default: now, ``time.time_ns()``)."""
        struct.pack_into(
            _BOX_FORMAT,
            self._map,
            0,
            _MAGIC,
            phase_index,
            state,
            -1 if iteration is None else iteration,
            os.getpid(),
            time.time_ns() if since_ns is None else since_ns,
        )


def read_box(path: Path) -> dict | None:
    """``{"phase", "iteration", "state", "pid", "since_ns"}`` from an activity file, or None."""
    from ptdp.engine.activity import PHASES

    try:
        raw = path.read_bytes()[: struct.calcsize(_BOX_FORMAT)]
        magic, phase, state, iteration, pid, since = struct.unpack(_BOX_FORMAT, raw)
    except (OSError, struct.error):
        return None
    if magic != _MAGIC:
        return None
    return {
        "phase": PHASES[phase] if phase < len(PHASES) else "?",
        "iteration": None if iteration < 0 else iteration,
        "state": state,
        "pid": pid,
        "since_ns": since,
    }


@contextmanager
def recording(rank: int, attempt: int = 0):
    """Leave this worker's records (module docstring) while the block runs; nothing without
    :data:`DIR_ENV`. An exception leaving the block is recorded and raised on."""
    from ptdp.engine import activity

    root = os.environ.get(DIR_ENV)
    if not root:
        yield
        return
    folder = attempt_dir(root, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    box = ActivityBox(folder / f"rank{rank}.activity")
    activity.mirror_to(box)
    signal_file = open(folder / f"rank{rank}.signal", "w")
    faulthandler.enable(file=signal_file, all_threads=False)
    faulthandler.register(signal.SIGTERM, file=signal_file, all_threads=False, chain=True)
    try:
        yield
        box.write(activity.phase_index(), activity.CURRENT.iteration, FINISHED)
    except BaseException as err:
        if not (isinstance(err, SystemExit) and err.code in (0, None)):
            _write_error(folder / f"rank{rank}.error.json", err)
            box.write(activity.phase_index(), activity.CURRENT.iteration, RAISED)
        raise
    finally:
        activity.mirror_to(None)
        faulthandler.unregister(signal.SIGTERM)
        faulthandler.disable()
        signal_file.close()


def _write_error(path: Path, err: BaseException) -> None:
    from ptdp.engine import activity

    record = {
        "time_ns": time.time_ns(),
        "type": type(err).__name__,
        "message": str(err).strip(),
        "consequence": isinstance(err, activity.CollectiveError),
        "phase": activity.CURRENT.phase,
        "iteration": activity.CURRENT.iteration,
        "traceback": "".join(traceback.format_exception(err)),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a failed attempt ended, as its records tell."""

    rank: int
    kind: str
    """``raised`` (an error of its own), ``collective`` (a peer's failure reached it), ``signal``
    (a fatal signal), ``sigterm``, ``silent`` (no record: SIGKILL) or ``finished``; from
    :func:`diagnose` after an NCCL timeout also ``watchdog`` (aborted by NCCL's watchdog) and
    ``stalled`` (the rank the others waited for)."""
    time_ns: int | None
    summary: str
    """One line: the error, or the signal."""
    phase: str | None = None
    iteration: int | None = None
    detail: str = ""
    """The traceback of an error, or the stack at a fatal signal."""
    pid: int | None = None
    since_ns: int | None = None
    """When it entered ``phase`` (``time.time_ns()``)."""

    def where(self) -> str:
        if self.phase is None:
            return ""
        at = f" at iteration {self.iteration}" if self.iteration is not None else " before the first iteration"
        return f"in {self.phase}{at}"


def read_rank_end(folder: Path, rank: int) -> RankEnd:
    """How ``rank`` ended, from its records in ``folder``."""
    box = read_box(folder / f"rank{rank}.activity")
    phase, iteration, pid = (box["phase"], box["iteration"], box["pid"]) if box else (None, None, None)
    return dataclasses.replace(
        _rank_end(folder, rank, box, phase, iteration, pid), since_ns=box["since_ns"] if box else None
    )


def _rank_end(folder: Path, rank: int, box: dict | None, phase, iteration, pid) -> RankEnd:
    error_path, signal_path = folder / f"rank{rank}.error.json", folder / f"rank{rank}.signal"
    if error_path.is_file():
        try:
            e = json.loads(error_path.read_text())
            first = (e["message"].splitlines() or [""])[0]
            if e["consequence"]:  # the message itself names the operation, peers and stalled ranks
                return RankEnd(
                    rank,
                    "collective",
                    e["time_ns"],
                    e["type"],
                    e.get("phase", phase),
                    e.get("iteration", iteration),
                    e["message"],
                    pid,
                )
            return RankEnd(
                rank,
                "raised",
                e["time_ns"],
                f"{e['type']}: {first}" if first else e["type"],
                e.get("phase", phase),
                e.get("iteration", iteration),
                e.get("traceback", ""),
                pid,
            )
        except (OSError, ValueError, KeyError, TypeError):
            pass
    text = signal_path.read_text(errors="replace") if signal_path.is_file() else ""
    if text.strip():
        first = text.strip().splitlines()[0]
        kind = "signal" if first.startswith("Fatal Python error") else "sigterm"  # register() writes no header
        name = first.removeprefix("Fatal Python error: ").strip()
        return RankEnd(
            rank,
            kind,
            signal_path.stat().st_mtime_ns,
            "received SIGTERM" if kind == "sigterm" else f"died of a fatal signal ({name})",
            phase,
            iteration,
            text,
            pid,
        )
    if box and box["state"] == FINISHED:
        return RankEnd(rank, "finished", None, "finished", phase, iteration, pid=pid)
    if box is None:
        return RankEnd(rank, "silent", None, "left no record (it never started, or was killed at once)")
    return RankEnd(
        rank,
        "silent",
        None,
        "was killed without a trace (SIGKILL, e.g. by the out-of-memory killer or kill -9)",
        phase,
        iteration,
        pid=pid,
    )


_FOLLOWERS = (  # how the other ranks ended, one rank / several
    ("collective", "failed in a collective with it", "failed in collectives with it"),
    ("sigterm", "was stopped by the launcher", "were stopped by the launcher"),
    ("silent", "ended without a record", "ended without a record"),
    ("raised", "raised an error of its own", "raised errors of their own"),
    ("signal", "died of a fatal signal", "died of fatal signals"),
    (
        "watchdog",
        "was aborted by NCCL's watchdog (a collective timed out)",
        "were aborted by NCCL's watchdog (a collective timed out)",
    ),
)


@dataclass(frozen=True)
class Diagnosis:
    first: RankEnd
    others: list[RankEnd]

    def message(self, *, head: str | None = None, exit_text: str | None = None, traceback_lines: int = 12) -> str:
        """The paragraph naming the rank that failed first (``head``, default ``worker rank R``),
        how (``exit_text``: the exit code or signal the launcher saw, when known) and where, and
        that the others' errors follow from it."""
        f = self.first
        where = f", {f.where()}" if f.where() else ""
        if exit_text and f.kind == "silent":
            how = exit_text
        else:
            how = f.summary + (f" ({exit_text})" if exit_text else "")
        lines = [f"{head or f'worker rank {f.rank}'} failed first{where}: {how}"]
        if f.detail.strip() and f.kind in ("raised", "signal", "collective", "watchdog"):
            tail = f.detail.rstrip().splitlines()[-traceback_lines:]
            lines += [line if f.kind == "collective" else "  " + line for line in tail]
        follow = [o for o in self.others if o.kind != "finished"]
        if follow:
            parts = []
            for kind, one, many in _FOLLOWERS:
                ranks = [o.rank for o in follow if o.kind == kind]
                if ranks:
                    text = many if len(ranks) > 1 else one
                    parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {text}")
            lines.append("the other ranks' errors follow from it: " + "; ".join(parts))
            example = next((o for o in follow if o.kind == "collective"), None)
            if example is not None:
                lines.append(f"  (e.g. {example.detail.splitlines()[0] if example.detail else example.summary})")
            lines += [f"  (rank {o.rank} {o.summary}, {o.where()})" for o in follow if o.kind == "watchdog"][:3]
        return "\n".join(lines)


def diagnose(folder: Path, world_size: int, timeout_s: float | None = None) -> Diagnosis | None:
    """Read every rank's records of one attempt and pick the rank that failed first (module
    docstring); None when there are no records. ``timeout_s``: the process-group timeout, which
    tells NCCL watchdog aborts apart (None: no abort is read as one)."""
    if not folder.is_dir():
        return None
    ends = [read_rank_end(folder, r) for r in range(world_size)]
    if all(e.kind == "silent" and e.phase is None for e in ends):
        return None
    aborted = watchdog_aborts(ends, timeout_s)
    if aborted and not any(e.kind == "raised" for e in ends):
        return _watchdog_diagnosis(ends, aborted)

    def earliest(kinds: tuple[str, ...]) -> RankEnd | None:
        found = [e for e in ends if e.kind in kinds]
        return min(found, key=lambda e: (e.time_ns if e.time_ns is not None else 0, e.rank)) if found else None

    first = (
        earliest(("raised", "signal")) or earliest(("silent",)) or earliest(("collective",)) or earliest(("sigterm",))
    )
    if first is None:
        return None
    return Diagnosis(first, [e for e in ends if e.rank != first.rank])


def watchdog_aborts(ends: list[RankEnd], timeout_s: float | None) -> list[RankEnd]:
    """The ranks that NCCL's watchdog aborted (a collective that timed out): those that died of
    SIGABRT after at least :data:`WATCHDOG_FRACTION` of ``timeout_s`` in their last phase, and all
    that died of SIGABRT when, at the first abort, another rank (not aborted, no error of its own)
    had made no progress for that long. The second case is a GPU host that ran ahead of its
    asynchronous collective into a later phase before it blocked."""
    if not timeout_s:
        return []
    limit = WATCHDOG_FRACTION * timeout_s * 1e9
    aborts = [
        (e, e.time_ns, e.since_ns)
        for e in ends
        if e.kind == "signal" and e.summary.endswith("(Aborted)") and e.time_ns is not None and e.since_ns is not None
    ]
    if not aborts:
        return []
    first = min(time_ns for _, time_ns, _ in aborts)
    idle = any(
        e.kind in ("sigterm", "silent", "collective") and e.since_ns is not None and first - e.since_ns >= limit
        for e in ends
    )
    return [e for e, time_ns, since_ns in aborts if idle or time_ns - since_ns >= limit]


def _times(end: RankEnd) -> tuple[int, int]:
    """``(time_ns, since_ns)`` of an end that has both (every abort :func:`watchdog_aborts` returns)."""
    if end.time_ns is None or end.since_ns is None:
        raise ValueError(f"rank {end.rank}'s record has no end time or phase start")
    return end.time_ns, end.since_ns


def _watchdog_diagnosis(ends: list[RankEnd], aborted: list[RankEnd]) -> Diagnosis:
    """After NCCL watchdog aborts: the rank that was not aborted and made no progress for the
    longest time is named first (the one the aborted ranks waited for); if every rank was aborted,
    the first abort."""

    def waited(e: RankEnd) -> str:
        time_ns, since_ns = _times(e)
        return _duration(time_ns - since_ns)

    marked = {
        e.rank: dataclasses.replace(
            e,
            kind="watchdog",
            summary=f"was aborted by NCCL's watchdog (SIGABRT) {waited(e)} after entering its last phase",
        )
        for e in aborted
    }
    candidates = [
        (e, e.since_ns)
        for e in ends
        if e.rank not in marked and e.kind in ("sigterm", "silent", "collective") and e.since_ns is not None
    ]
    last_abort = max(_times(e)[0] for e in aborted)
    if candidates:
        stalled, since_ns = min(candidates, key=lambda c: (c[1], c[0].rank))
        first = dataclasses.replace(
            stalled,
            kind="stalled",
            summary=(
                f"made no progress for {_duration(last_abort - since_ns)} before NCCL's watchdog aborted "
                f"rank{'s' if len(marked) > 1 else ''} {', '.join(map(str, sorted(marked)))} (a collective timed out "
                f"waiting for it: likely the one that stopped responding; --distributed-timeout-minutes sets the limit)"
            ),
        )
    else:
        first = min(marked.values(), key=lambda e: (_times(e)[0], e.rank))
        first = dataclasses.replace(
            first, summary=first.summary + " (a collective timed out; --distributed-timeout-minutes sets the limit)"
        )
    others = [marked.get(e.rank, e) for e in ends if e.rank != first.rank]
    return Diagnosis(first, others)


def _duration(ns: int) -> str:
    return f"{ns / 60e9:.1f} min" if ns >= 60e9 else f"{ns / 1e9:.1f} s"
