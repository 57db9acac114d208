"""Which worker failed first, how, and where: the reading of the records each worker leaves
(:mod:`ptdp.run.rank_records`).

When one worker dies its peers fail a moment later in a collective, and PyTorch's launcher reports
whichever failed process it polls first. :func:`diagnose` names the rank that failed first: the
earliest that raised its own error or died of a fatal signal; else one with no record (SIGKILL,
e.g. the OOM killer); else the first collective error. The others are said to follow from it.

On NCCL a timed-out collective makes the watchdog abort the process (SIGABRT). A rank aborted after
at least :data:`WATCHDOG_FRACTION` of the timeout in one phase, or while another rank had stalled
that long, is read as a watchdog abort (:func:`watchdog_aborts`); the rank named first is then the
non-aborted one stalled longest. On a GPU the recorded phase may be past the timed-out collective
(the host runs ahead); NCCL's flight-recorder dump names the collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ptdp.run.rank_records import (
    RankEnd,
    read_rank_end,
)

__all__ = ["WATCHDOG_FRACTION", "Diagnosis", "diagnose", "watchdog_aborts"]

WATCHDOG_FRACTION = 0.9
"""Share of the process-group timeout that tells an NCCL watchdog abort (:func:`watchdog_aborts`)."""


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
