"""Prove a pipeline schedule correct and compute its bubble by pure simulation, with no process.

:func:`check_schedule` checks per rank: each (microbatch, chunk) forwarded once and backwarded once
after it; inputs received before use and outputs sent after; sends paired in order with the peer's
receives; every receive completes; in-flight microbatches within the kind's bound. It then proves
the runtime's programs (:mod:`ptdp.layout.pipeline.program`) deadlock-free under gloo's rules
(:func:`simulate`: sends never block) and NCCL's (:func:`ptdp.layout.pipeline.nccl_model.simulate_nccl`).

:func:`simulate` returns each rank's busy and idle time for fixed per-chunk forward/backward times;
:func:`ideal_idle_time` is the formula it must meet, (p - 1) (t_f + t_b) / v per rank (SC21, §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.layout.pipeline.nccl_model import ScheduleError, simulate_nccl
from ptdp.layout.pipeline.program import P2PGroup, Step, programs_from_schedule
from ptdp.layout.pipeline.schedule import COMPUTE, Action, boundary, peer, warmup_forwards

__all__ = ["check_programs", "check_schedule", "ideal_idle_time", "in_flight_bound", "programs_of", "simulate"]


def in_flight_bound(kind: str, p: int, m: int, v: int, r: int) -> int:
    """Most (microbatch, chunk) activations rank r may hold: GPipe m v; 1F1B min(p - r, m);
    interleaved its warm-up + 1 (at most m v)."""
    if kind in ("gpipe", "forward-only"):
        return m * v
    return min(warmup_forwards(kind, p, m, v, r) + 1, m * v)


def check_schedule(
    schedule: list[list[Action]],
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    max_in_flight: list[int] | None = None,
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is correct (see the module docstring)."""
    p = len(schedule)
    for r, acts in enumerate(schedule):
        _check_rank(r, acts, num_microbatches, virtual_stages, p, max_in_flight[r] if max_in_flight else None)
    check_programs(programs_of(schedule, virtual_stages), virtual_stages=virtual_stages)


def programs_of(schedule: list[list[Action]], virtual_stages: int = 1) -> list[list[Step]]:
    """The runtime's programs for ``schedule``; ScheduleError when its computes wait on each other
    in a cycle (a deadlock whatever the transfers)."""
    try:
        return programs_from_schedule(schedule, virtual_stages)
    except ValueError as err:
        raise ScheduleError(f"deadlock: {err}") from err


def check_programs(programs: list[list[Step]], *, virtual_stages: int = 1) -> None:
    """ScheduleError unless ``programs`` complete under gloo's rules and under NCCL's."""
    _simulate_programs(programs, virtual_stages, 1.0, 2.0)
    simulate_nccl(programs)


def _check_rank(r: int, acts: list[Action], m: int, v: int, p: int, bound: int | None) -> None:
    seen: set[tuple[str, int, int]] = set()
    in_flight = 0
    for a in acts:
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise ScheduleError(f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {a.chunk} appears twice")
        seen.add(key)
        if not (0 <= a.microbatch < m and 0 <= a.chunk < v):
            raise ScheduleError(f"rank {r}: microbatch {a.microbatch} chunk {a.chunk} outside m={m}, v={v}")
        first, last = r == 0 and a.chunk == 0, r == p - 1 and a.chunk == v - 1
        needs = {
            "forward": [] if first else ["recv_forward"],
            "send_forward": ["forward"],
            "backward": ["forward"] + ([] if last else ["recv_backward"]),
            "send_backward": ["backward"],
        }.get(a.kind, [])
        for need in needs:
            if (need, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(
                    f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {a.chunk} before its {need}"
                )
        in_flight += {"forward": 1, "backward": -1}.get(a.kind, 0)
        if bound is not None and in_flight > bound:
            raise ScheduleError(f"rank {r}: {in_flight} microbatches in flight > bound {bound}")
    kinds = ("forward", "backward") if any(a.kind == "backward" for a in acts) else ("forward",)
    for i in range(m):
        for c in range(v):
            for kind in kinds:
                if (kind, i, c) not in seen:
                    raise ScheduleError(f"rank {r}: microbatch {i} chunk {c} has no {kind}")


@dataclass(frozen=True)
class Timeline:
    """Simulated run: per rank, ``(action, start, end)`` of each compute; busy time; makespan."""

    events: list[list[tuple[Action, float, float]]]
    busy: list[float]
    makespan: float

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]


def simulate(
    schedule: list[list[Action]], *, virtual_stages: int = 1, forward_time: float = 1.0, backward_time: float = 2.0
) -> Timeline:
    """Run the programs of ``schedule`` on all ranks together under gloo's rules: a chunk's forward
    takes ``forward_time / v``, its backward ``backward_time / v``; a group of transfers completes
    when the sends of all its receives are posted (sends never block).

    Raises :class:`ScheduleError` on a deadlock or a send paired with the wrong receive.
    """
    return _simulate_programs(programs_of(schedule, virtual_stages), virtual_stages, forward_time, backward_time)


def _simulate_programs(programs: list[list[Step]], v: int, forward_time: float, backward_time: float) -> Timeline:
    p = len(programs)
    steps = [[[o.action for o in s.ops] if isinstance(s, P2PGroup) else [s] for s in program] for program in programs]
    pc, clock = [0] * p, [0.0] * p
    posted: dict[tuple, list[tuple[tuple[int, int], float]]] = {}
    where: dict[tuple, dict[tuple[int, int], int]] = {}  # channel -> key -> its first position in posted
    posted_at: list[int] = [-1] * p
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if step[0].kind in COMPUTE:
                    duration = (forward_time if step[0].kind == "forward" else backward_time) / v
                    events[r].append((step[0], clock[r], clock[r] + duration))
                    clock[r] += duration
                    busy[r] += duration
                elif not _transfer(r, step, p, pc, clock, (posted, where), posted_at):
                    break
                pc[r] += 1
                progress = True
    stuck = [(r, steps[r][pc[r]]) for r in range(p) if pc[r] < len(steps[r])]
    if stuck:
        raise ScheduleError(
            "deadlock: "
            + "; ".join(f"rank {r} waits in {[(a.kind, a.microbatch, a.chunk) for a in s]}" for r, s in stuck)
        )
    return Timeline(events, busy, max(clock))


def _channels(r: int, a: Action, p: int) -> tuple[tuple, tuple, tuple[int, int]]:
    other = peer(a, r, p)
    direction = "fwd" if a.kind.endswith("forward") else "bwd"
    sending = a.kind.startswith("send")
    src, dst = (r, other) if sending else (other, r)
    mine = (src, dst, direction, "send" if sending else "recv")
    theirs = (src, dst, direction, "recv" if sending else "send")
    return mine, theirs, (a.microbatch, boundary(a, r, p))


def _transfer(r, step, p, pc, clock, book, posted_at) -> bool:
    """Post the batch once; it completes (advancing the clock) when every receive in it has its
    send posted. Sends never block: the runtime waits for them at the end of the step.
    ``book``: (each channel's posted (key, time) in order, each key's first position there)."""
    posted, where = book
    if posted_at[r] < pc[r]:
        for a in step:
            mine, _, key = _channels(r, a, p)
            queue = posted.setdefault(mine, [])
            where.setdefault(mine, {}).setdefault(key, len(queue))
            queue.append((key, clock[r]))
        posted_at[r] = pc[r]
    done = clock[r]
    for a in step:
        mine, theirs, key = _channels(r, a, p)
        index = where[mine][key]
        other = posted.get(theirs, [])
        if index >= len(other):
            if a.kind.startswith("send"):
                continue  # checked when the receiver posts
            return False
        if other[index][0] != key:
            raise ScheduleError(
                f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {a.chunk} is paired with microbatch "
                f"{other[index][0][0]} at stage boundary {other[index][0][1]} by the peer"
            )
        if a.kind.startswith("recv"):
            done = max(done, other[index][1])
    clock[r] = done
    return True


def ideal_idle_time(p: int, v: int, forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Idle time per rank of a perfect schedule: (p - 1) (t_f + t_b) / v."""
    return (p - 1) * (forward_time + backward_time) / v
