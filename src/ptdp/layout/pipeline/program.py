"""A pipeline rank's program: its computes and point-to-point groups, exactly as the runtime posts
them (pure data, no torch). Each :class:`P2PGroup` is one ``batch_isend_irecv`` call (one
``ncclGroupStart``/``ncclGroupEnd`` on one communicator's stream). Grouping the transfers as the
schedule lists them deadlocks interleaved 1F1B on NCCL once m > p, so they are grouped by time
(in the spirit of Megatron-LM's ``send_forward_backward_recv_forward_backward``, SC21 §2.2):

1. Time the computes: a forward, B and W 1 unit each, a whole backward 2, transfers free; a
   compute starts when its rank is free and its input has been produced.
2. A transfer happens when its producer ends, on the sender and the receiver alike.
3. On each rank, the transfers of one time form one group (send-next, recv-prev, send-prev,
   recv-next), after the computes starting before that time and before the others.

Groups are in increasing time on every rank and a send and its receive share a time, so by
induction every group completes (checked by :func:`ptdp.layout.pipeline.nccl_model.simulate_nccl`).
In torch 2.13's ``ProcessGroupNCCL::pointToPoint``, operations inside a coalescing group use the
process group's own communicator (a lone ``isend`` may get a two-rank one); ptdp posts no lone
operation, so every group runs on :data:`COMMUNICATOR`, in program order. Tags:
``"act:mb{i}:vs{k}"`` is microbatch i's activation from virtual stage k (to k + 1),
``"grad:mb{i}:vs{k}"`` the gradient of stage k's input (to k - 1). Between two neighbours both
directions may be in one group (the V placement: chunk 0's activations go one way, chunk 1's the
other); NCCL pairs the n-th send from a to b with the n-th receive on b from a, and both ends order
a group's operations alike (:data:`GROUP_ORDER`, then microbatch and stage boundary). A hand-over
(:data:`~ptdp.layout.pipeline.schedule.HANDOVER`) stays in the program, just before its compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ptdp.layout.pipeline.schedule import (
    COMPUTE,
    INPUT_GRADIENT,
    TRANSFER,
    Action,
    boundary,
    build_schedule,
    peer,
    schedule_placement,
)
from ptdp.layout.pipeline.timing import Producers, StageTimes, compute_times, producers

#: the NCCL communicator (and stream) every pipeline group runs on: the pipeline group's own
COMMUNICATOR = "pp"
#: a group's operations in this order: send-next, recv-prev, send-prev, recv-next
GROUP_ORDER = ("send_forward", "recv_forward", "send_backward", "recv_backward")
#: schedule time of each compute, in units of a chunk's forward
DURATION = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a group: ``op`` "send" or "recv", ``peer`` the pipeline rank,
    ``tag`` the same string on a send and its receive, ``action`` the schedule's transfer."""

    op: str
    peer: int
    tag: str
    action: Action


@dataclass(frozen=True)
class P2PGroup:
    """Point-to-point operations posted together (one ``batch_isend_irecv``) on ``communicator``,
    at schedule time ``time`` (units of one chunk's forward)."""

    communicator: str
    ops: tuple[P2POp, ...]
    time: int


Step = Action | P2PGroup


@lru_cache(maxsize=64)
def build_programs(
    kind: str,
    pp_size: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    times: StageTimes | None = None,
    memory_limit: int | None = None,
    placement: str | None = None,
) -> tuple[tuple[Step, ...], ...]:
    """Per pipeline rank, its program: compute :class:`Action` s and :class:`P2PGroup` s in the order
    the runtime runs and posts them (cached per shape, read-only), checked under
    :func:`ptdp.layout.pipeline.nccl_model.simulate_nccl` before being returned. ``times`` and
    ``memory_limit``: the ``auto`` schedule's, ``placement`` ``forward-only``'s
    (:func:`ptdp.layout.pipeline.schedule.build_schedule`).

    Raises ValueError (:func:`ptdp.layout.pipeline.schedule.check_schedule_args`) for a kind that
    cannot run with these sizes, ScheduleError for a program that would deadlock on NCCL.
    """
    from ptdp.layout.pipeline.nccl_model import simulate_nccl

    schedule = build_schedule(
        kind, pp_size, num_microbatches, virtual_stages, times=times, memory_limit=memory_limit, placement=placement
    )
    programs = programs_from_schedule(schedule, virtual_stages, schedule_placement(kind, placement))
    simulate_nccl(programs)
    return tuple(tuple(program) for program in programs)


def programs_from_schedule(
    schedule: list[list[Action]], virtual_stages: int = 1, placement: str = "looped"
) -> list[list[Step]]:
    """Group the transfers of ``schedule`` (per rank: computes, hand-overs and the transfers around
    them) by the time their producer ends (see the module docstring). Raises ValueError when the
    schedule's computes wait on each other in a cycle."""
    p = len(schedule)
    start, end = compute_times(schedule, DURATION, virtual_stages=virtual_stages, placement=placement)
    made = producers(schedule, placement)
    programs = []
    for r, acts in enumerate(schedule):
        groups: dict[int, list[Action]] = {}
        for a in acts:
            if a.kind in TRANSFER:
                groups.setdefault(end[_producer(a, r, p, made, placement)], []).append(a)
        # a hand-over goes with the compute it feeds: the forward, or the backward (or B)
        feeds = {
            (a.kind == "forward", a.microbatch, a.chunk): a for a in acts if a.kind in ("forward", *INPUT_GRADIENT)
        }
        program: list[Step] = []
        times, i = sorted(groups), 0
        for a in acts:
            if a.kind in TRANSFER:
                continue
            at = start[(r, a if a.kind in COMPUTE else feeds[(a.kind == "handover_forward", a.microbatch, a.chunk)])]
            while i < len(times) and times[i] <= at:
                program.append(_group(groups[times[i]], times[i], r, p, placement))
                i += 1
            program.append(a)
        program += [_group(groups[t], t, r, p, placement) for t in times[i:]]
        programs.append(program)
    return programs


def program_makespan(programs: Sequence[Sequence[Step]], duration) -> float:
    """The time ``programs`` take as the runtime runs them, each compute ``duration(step)`` long
    and transfers instant: a rank posts its groups in program order without waiting; a group runs
    once its rank's previous group ended and ends once every partner group runs (NCCL's ordered
    groups and rendezvous, :mod:`ptdp.layout.pipeline.nccl_model`); a compute first waits for the
    group receiving its input. The free-transfer simulation of the same computes
    (:func:`ptdp.layout.pipeline.timing.compute_times`) is the bound. Raises ScheduleError for a
    program that deadlocks (:func:`ptdp.layout.pipeline.nccl_model.simulate_nccl`)."""
    from ptdp.layout.pipeline.nccl_model import ScheduleError, _pair, simulate_nccl

    steps = [list(program) for program in programs]
    partner = _pair(
        steps, lambda step: step.communicator, lambda step: step.ops, lambda step: isinstance(step, P2PGroup)
    )
    p = len(steps)
    receives: list[dict[tuple[str, int, int], int]] = [{} for _ in range(p)]
    for r, program in enumerate(steps):
        for i, step in enumerate(program):
            if isinstance(step, P2PGroup):
                for o in step.ops:
                    if o.op == "recv":
                        receives[r][(o.action.kind, o.action.microbatch, o.action.chunk)] = i
    pc, clock, last = [0] * p, [0.0] * p, [-1] * p
    start: dict[tuple[int, int], float] = {}
    end: dict[tuple[int, int], float] = {}
    while True:
        moved = False
        for r in range(p):
            while pc[r] < len(steps[r]):
                step, i = steps[r][pc[r]], pc[r]
                if isinstance(step, P2PGroup):
                    if last[r] >= 0 and (r, last[r]) not in end:
                        break
                    start[(r, i)] = max(clock[r], end.get((r, last[r]), 0.0))
                    last[r] = i
                elif step.kind in COMPUTE:
                    need = receives[r].get(
                        ("recv_forward" if step.kind == "forward" else "recv_backward", step.microbatch, step.chunk)
                    )
                    if step.kind != "backward_weight" and need is not None:
                        if (r, need) not in end:
                            break
                        clock[r] = max(clock[r], end[(r, need)])
                    clock[r] += duration(step)
                pc[r] += 1
                moved = True
        for (r, i), began in start.items():
            if (r, i) not in end:
                group = steps[r][i]
                assert isinstance(group, P2PGroup)
                peers = [partner[(r, i, j)][:2] for j in range(len(group.ops))]
                if all(q in start for q in peers):
                    end[(r, i)] = max([began] + [start[q] for q in peers])
                    moved = True
        if all(pc[r] == len(steps[r]) for r in range(p)) and len(end) == len(start):
            return max(clock + list(end.values()))
        if not moved:
            simulate_nccl(steps)  # names the deadlock
            raise ScheduleError("the programs do not finish")


def tag(action: Action, rank: int, pp_size: int, placement: str = "looped") -> str:
    """The tag of a transfer: the same string on the send and on the receive it pairs with."""
    edge = boundary(action, rank, pp_size, placement)
    if action.kind.endswith("forward"):
        return f"act:mb{action.microbatch}:vs{edge}"
    return f"grad:mb{action.microbatch}:vs{edge + 1}"


def _producer(a: Action, r: int, p: int, made: Producers, placement: str) -> tuple[int, Action]:
    """The compute whose end a transfer waits for, on the sender and the receiver alike: the
    forward of the stage before the boundary, or the backward (or B) of the stage after it."""
    edge = boundary(a, r, p, placement)
    key = ("forward", a.microbatch, edge) if a.kind.endswith("forward") else ("backward", a.microbatch, edge + 1)
    if key not in made:
        raise ValueError(f"rank {r}'s {a.kind} of microbatch {a.microbatch}, chunk {a.chunk} has no producer")
    return made[key]


def _group(actions: list[Action], time: int, r: int, p: int, placement: str) -> P2PGroup:
    ordered = sorted(actions, key=lambda a: (GROUP_ORDER.index(a.kind), a.microbatch, boundary(a, r, p, placement)))
    ops = tuple(P2POp(a.kind[:4], peer(a, r, p, placement), tag(a, r, p, placement), a) for a in ordered)
    return P2PGroup(COMMUNICATOR, ops, time)


def program_json(programs: Sequence[Sequence[Step]]) -> dict:
    """``{"ranks": [{"rank", "program", "p2p_groups"}]}``: each rank's steps as strings (computes
    ``"forward mb3 chunk1"``, groups ``"p2p [send act:mb3:vs1 -> 2, ...]"``) and its groups in posting
    order, each ``{"communicator", "time", "ops": [{"op", "peer", "tag"}]}``."""
    ranks = []
    for r, program in enumerate(programs):
        groups = [step for step in program if isinstance(step, P2PGroup)]
        ranks.append(
            {
                "rank": r,
                "program": [describe(step) for step in program],
                "p2p_groups": [
                    {
                        "communicator": g.communicator,
                        "time": g.time,
                        "ops": [{"op": o.op, "peer": o.peer, "tag": o.tag} for o in g.ops],
                    }
                    for g in groups
                ],
            }
        )
    return {"ranks": ranks}


def describe(step: Step) -> str:
    """One line for a step of a program."""
    if isinstance(step, P2PGroup):
        return (
            "p2p [" + ", ".join(f"{o.op} {o.tag} {'->' if o.op == 'send' else '<-'} {o.peer}" for o in step.ops) + "]"
        )
    return f"{step.kind} mb{step.microbatch} chunk{step.chunk}"
