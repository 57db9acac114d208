"""When each compute of a pipeline schedule runs, for given durations (pure, no torch).

A compute starts when its rank has finished the computes before it and its input exists: a
forward needs the previous virtual stage's forward of the microbatch, a whole backward or a B
(``backward_input``) the next stage's whole backward or B, each plus ``p2p`` when that stage is on
another rank (a hand-over on the same rank is free). A W (``backward_weight``) needs only its rank's
own B, earlier in its list. Transfers and hand-overs take no time of their own. Schedules here are
anything with per-rank lists of items with ``kind``, ``microbatch`` and ``chunk``
(:class:`ptdp.layout.pipeline.schedule.Action`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ptdp.layout.pipeline.placement import virtual_stage


class Item(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def chunk(self) -> int: ...


#: (direction, microbatch, virtual stage) -> (rank, compute) making that stage's output
#: ("forward") or the gradient of its input ("backward": a whole backward or a B)
Producers = dict[tuple[str, int, int], tuple[int, Any]]


def producers(schedule: Sequence[Sequence[Item]], placement: str = "looped") -> Producers:
    """Which compute of which rank makes each stage's output and each stage's input gradient."""
    p = len(schedule)
    out: Producers = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.kind in ("forward", "backward", "backward_input"):
                direction = "forward" if a.kind == "forward" else "backward"
                out[(direction, a.microbatch, virtual_stage(r, a.chunk, p, placement))] = (r, a)
    return out


def input_producer(
    a: Item, r: int, p: int, stages: int, made: Producers, placement: str = "looped"
) -> tuple[int, Any] | None:
    """The compute on a neighbouring virtual stage whose output ``a`` (on rank r) needs: None for
    the first stage's forward, the last stage's backward and every W. Raises ValueError when no
    rank computes it."""
    if a.kind not in ("forward", "backward", "backward_input"):
        return None
    stage = virtual_stage(r, a.chunk, p, placement)
    source = stage - 1 if a.kind == "forward" else stage + 1
    if not 0 <= source < stages:
        return None
    key = ("forward" if a.kind == "forward" else "backward", a.microbatch, source)
    if key not in made:
        raise ValueError(f"rank {r}'s {a.kind} of microbatch {a.microbatch}, chunk {a.chunk} has no input")
    return made[key]


def compute_times(
    schedule: Sequence[Sequence[Item]],
    durations: Mapping[str, Any],
    *,
    virtual_stages: int = 1,
    placement: str = "looped",
    p2p: Any = 0,
) -> tuple[dict, dict]:
    """Start and end of every compute, keyed ``(rank, item)``, each taking ``durations[kind]``
    (items of other kinds are skipped). Raises ValueError when the computes wait on each other in a
    cycle (the schedule deadlocks whatever its transfers)."""
    p = len(schedule)
    made = producers(schedule, placement)
    computes = [[a for a in acts if a.kind in durations] for acts in schedule]
    start: dict[tuple[int, Any], Any] = {}
    end: dict[tuple[int, Any], Any] = {}
    pc, clock = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(computes[r]):
                a = computes[r][pc[r]]
                dep = input_producer(a, r, p, p * virtual_stages, made, placement)
                if dep is not None and dep not in end:
                    break
                ready = 0 if dep is None else end[dep] + (p2p if dep[0] != r else 0)
                start[(r, a)] = begin = max(clock[r], ready)
                clock[r] = end[(r, a)] = begin + durations[a.kind]
                pc[r] += 1
                progress = True
    stuck = [(r, computes[r][pc[r]]) for r in range(p) if pc[r] < len(computes[r])]
    if stuck:
        raise ValueError(
            "the schedule's computes wait on each other: "
            + "; ".join(f"rank {r} at {a.kind} of microbatch {a.microbatch} chunk {a.chunk}" for r, a in stuck)
        )
    return start, end
