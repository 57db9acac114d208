"""The records each worker leaves, so that the launcher can tell which failed first, how and where.

Each worker started by ``ptdp train`` writes, in the folder :data:`DIR_ENV` names (one sub-folder
per attempt):

- ``rank<R>.activity``: a 64-byte memory-mapped file with the current phase, iteration and entry
  time (:mod:`ptdp.engine.activity`; no system call), so it survives even SIGKILL;
- ``rank<R>.error.json``: on an exception: the exception, traceback, time (ns) and whether it is a
  peer's failure (:class:`~ptdp.engine.activity.CollectiveError`);
- ``rank<R>.signal``: ``faulthandler`` output on a fatal signal or SIGTERM, written from the signal
  handler, so also inside a blocked collective; its mtime is when.

:func:`read_rank_end` reads one rank's records; :mod:`ptdp.run.postmortem` interprets them.
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
    :func:`ptdp.run.postmortem.diagnose` after an NCCL timeout also ``watchdog`` (aborted by NCCL's watchdog) and
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
