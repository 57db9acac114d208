"""Prove a pipeline schedule correct and compute its bubble by pure simulation, with no process.

:func:`check_schedule` checks per rank: each (microbatch, chunk) forwarded once, then backwarded
once (a whole backward, or a B and later its W); inputs received (or handed over from the rank's
other chunk) before use and outputs sent after; sends paired in order with the peer's receives;
every receive completes; in-flight activations within the kind's bound. It then proves the
runtime's programs (:mod:`ptdp.layout.pipeline.program`) deadlock-free under gloo's rules
(:func:`simulate`: sends never block) and NCCL's (:func:`ptdp.layout.pipeline.nccl_model.simulate_nccl`).

:func:`simulate` returns each rank's busy and idle time for fixed per-chunk forward/backward times;
:func:`ideal_idle_time` is the formula it must meet, (p - 1) (t_f + t_b) / v per rank (SC21, §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.layout.pipeline.nccl_model import ScheduleError, simulate_nccl
from ptdp.layout.pipeline.placement import stage_owner, virtual_stage
from ptdp.layout.pipeline.program import P2PGroup, Step, programs_from_schedule
from ptdp.layout.pipeline.schedule import COMPUTE, HANDOVER, Action, warmup_forwards

__all__ = ["check_programs", "check_schedule", "ideal_idle_time", "in_flight_bound", "programs_of", "simulate"]


def in_flight_bound(kind: str, p: int, m: int, v: int, r: int, memory_limit: int | None = None) -> int:
    """Most (microbatch, chunk) activations rank r may hold, each from its forward to its backward
    or B: GPipe m v; 1F1B min(p - r, m); interleaved its warm-up + 1 (at most m v); ZB-H1 p, ZB-H2
    2p - 1 (at most m); ZB-V 2p chunks, p microbatches (at most 2m); DualPipeV 2p + 1 chunks; auto
    its memory limit (default p)."""
    if kind in ("gpipe", "forward-only"):
        return m * v
    limit = p if memory_limit is None else memory_limit
    bound = {"zb-h1": p, "zb-h2": 2 * p - 1, "zb-v": 2 * p, "dualpipev": 2 * p + 1, "auto": limit}.get(kind)
    if bound is not None:
        return min(bound, m * v)
    return min(warmup_forwards(kind, p, m, v, r) + 1, m * v)


def check_schedule(
    schedule: list[list[Action]],
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    max_in_flight: list[int] | None = None,
    placement: str = "looped",
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is correct (see the module docstring);
    ``max_in_flight``: per rank, the most (microbatch, chunk) activations held, each from its
    forward to its backward or B (after B only what its W needs stays, the smaller M_W of Qi et
    al., arXiv:2401.10241, Table 1)."""
    p = len(schedule)
    for r, acts in enumerate(schedule):
        bound = max_in_flight[r] if max_in_flight else None
        _check_rank(r, acts, num_microbatches, virtual_stages, p, bound, placement)
    check_programs(programs_of(schedule, virtual_stages, placement), virtual_stages=virtual_stages)


def programs_of(schedule: list[list[Action]], virtual_stages: int = 1, placement: str = "looped") -> list[list[Step]]:
    """The runtime's programs for ``schedule``; ScheduleError when its computes wait on each other
    in a cycle (a deadlock whatever the transfers)."""
    try:
        return programs_from_schedule(schedule, virtual_stages, placement)
    except ValueError as err:
        raise ScheduleError(f"deadlock: {err}") from err


def check_programs(programs: list[list[Step]], *, virtual_stages: int = 1) -> None:
    """ScheduleError unless ``programs`` complete under gloo's rules and under NCCL's."""
    _simulate_programs(programs, virtual_stages, 1.0, 2.0)
    simulate_nccl(programs)


def _check_rank(r: int, acts: list[Action], m: int, v: int, p: int, bound: int | None, placement: str) -> None:
    seen: set[tuple[str, int, int]] = set()
    in_flight = 0
    for a in acts:
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise ScheduleError(f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {a.chunk} appears twice")
        seen.add(key)
        if not (0 <= a.microbatch < m and 0 <= a.chunk < v):
            raise ScheduleError(f"rank {r}: microbatch {a.microbatch} chunk {a.chunk} outside m={m}, v={v}")
        for need, chunk in _needs(a, r, p, v, placement):
            if not any((kind, a.microbatch, chunk) in seen for kind in need):
                raise ScheduleError(
                    f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {a.chunk} before its "
                    + " or ".join(need)
                    + ("" if chunk == a.chunk else f" of chunk {chunk}")
                )
        in_flight += {"forward": 1, "backward": -1, "backward_input": -1}.get(a.kind, 0)
        if bound is not None and in_flight > bound:
            raise ScheduleError(f"rank {r}: {in_flight} microbatches in flight > bound {bound}")
    trains = any(a.kind in COMPUTE and a.kind != "forward" for a in acts)
    for i in range(m):
        for c in range(v):
            if ("forward", i, c) not in seen:
                raise ScheduleError(f"rank {r}: microbatch {i} chunk {c} has no forward")
            whole, split = ("backward", i, c) in seen, ("backward_input", i, c) in seen
            if trains and whole == split:
                what = "a backward and a B" if whole else "backward"
                raise ScheduleError(f"rank {r}: microbatch {i} chunk {c} has {'no ' if not whole else ''}{what}")
            if split and ("backward_weight", i, c) not in seen:
                raise ScheduleError(f"rank {r}: microbatch {i} chunk {c} has no backward_weight after its B")


def _needs(a: Action, r: int, p: int, v: int, placement: str) -> list[tuple[tuple[str, ...], int]]:
    """What must come before ``a`` on rank r: per need, the kinds that satisfy it and their chunk."""
    stage, c = virtual_stage(r, a.chunk, p, placement), a.chunk
    first, last = stage == 0, stage == p * v - 1
    if a.kind == "forward":
        return [] if first else [(("recv_forward", "handover_forward"), c)]
    if a.kind in ("backward", "backward_input"):
        return [(("forward",), c)] + ([] if last else [(("recv_backward", "handover_backward"), c)])
    if a.kind in HANDOVER:  # the neighbouring stage must be this rank's
        source = stage - 1 if a.kind == "handover_forward" else stage + 1
        owner, chunk = stage_owner(source, p, placement)
        if owner != r or not 0 <= source < p * v:
            raise ScheduleError(
                f"rank {r}: {a.kind} of microbatch {a.microbatch} chunk {c}: stage {source} is not here"
            )
        return [(("forward",) if a.kind == "handover_forward" else ("backward", "backward_input"), chunk)]
    if a.kind == "backward_weight":
        return [(("backward_input",), c)]
    if a.kind == "send_forward":
        return [(("forward",), c)]
    return [(("backward", "backward_input"), c)] if a.kind == "send_backward" else []


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
    schedule: list[list[Action]],
    *,
    virtual_stages: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    placement: str = "looped",
) -> Timeline:
    """Run the programs of ``schedule`` on all ranks together under gloo's rules: a chunk's forward
    takes ``forward_time / v``, its backward ``backward_time / v`` (a B and a W half of it each); a
    group of transfers completes when the sends of all its receives are posted (sends never block).

    Raises :class:`ScheduleError` on a deadlock or a send paired with the wrong receive.
    """
    programs = programs_of(schedule, virtual_stages, placement)
    return _simulate_programs(programs, virtual_stages, forward_time, backward_time)


def _simulate_programs(programs: list[list[Step]], v: int, forward_time: float, backward_time: float) -> Timeline:
    p = len(programs)
    durations = {
        "forward": forward_time / v,
        "backward": backward_time / v,
        "backward_input": backward_time / (2 * v),
        "backward_weight": backward_time / (2 * v),
    }
    pc, clock = [0] * p, [0.0] * p
    posted: dict[tuple, list[tuple[str, float]]] = {}
    where: dict[tuple, dict[str, int]] = {}  # channel -> tag -> its first position in posted
    posted_at: list[int] = [-1] * p
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(programs[r]):
                step = programs[r][pc[r]]
                if isinstance(step, P2PGroup):
                    if not _transfer(r, step, pc, clock, (posted, where), posted_at):
                        break
                elif step.kind in COMPUTE:
                    duration = durations[step.kind]
                    events[r].append((step, clock[r], clock[r] + duration))
                    clock[r] += duration
                    busy[r] += duration
                pc[r] += 1  # a hand-over takes no time
                progress = True
    stuck = [(r, programs[r][pc[r]]) for r in range(p) if pc[r] < len(programs[r])]
    if stuck:
        raise ScheduleError(
            "deadlock: "
            + "; ".join(
                f"rank {r} waits in {[o.tag for o in s.ops] if isinstance(s, P2PGroup) else s}" for r, s in stuck
            )
        )
    return Timeline(events, busy, max(clock))


def _channels(r: int, o) -> tuple[tuple, tuple]:
    """(this operation's channel, its partner's): (sender, receiver, act/grad, send/recv); gloo
    matches by tag, and activations and gradients have tags of their own."""
    sending = o.op == "send"
    src_dst, what = (r, o.peer) if sending else (o.peer, r), o.tag.split(":")[0]
    return (*src_dst, what, o.op), (*src_dst, what, "recv" if sending else "send")


def _transfer(r, group, pc, clock, book, posted_at) -> bool:
    """Post the batch once; it completes (advancing the clock) when every receive in it has its
    send posted. Sends never block: the runtime waits for them at the end of the step.
    ``book``: (each channel's posted (tag, time) in order, each tag's first position there)."""
    posted, where = book
    if posted_at[r] < pc[r]:
        for o in group.ops:
            mine, _ = _channels(r, o)
            queue = posted.setdefault(mine, [])
            where.setdefault(mine, {}).setdefault(o.tag, len(queue))
            queue.append((o.tag, clock[r]))
        posted_at[r] = pc[r]
    done = clock[r]
    for o in group.ops:
        mine, theirs = _channels(r, o)
        index = where[mine][o.tag]
        other = posted.get(theirs, [])
        if index >= len(other):
            if o.op == "send":
                continue  # checked when the receiver posts
            return False
        if other[index][0] != o.tag:
            raise ScheduleError(f"rank {r}: {o.op} of {o.tag} is paired with {other[index][0]} by rank {o.peer}")
        if o.op == "recv":
            done = max(done, other[index][1])
    clock[r] = done
    return True


def ideal_idle_time(p: int, v: int, forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Idle time per rank of a perfect schedule: (p - 1) (t_f + t_b) / v."""
    return (p - 1) * (forward_time + backward_time) / v
