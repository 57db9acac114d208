"""A pipeline rank's program: its computes and point-to-point groups, exactly as the runtime posts
them (pure data, no torch). Each :class:`P2PGroup` is one ``batch_isend_irecv`` call (one
``ncclGroupStart``/``ncclGroupEnd`` on one communicator's stream). Grouping the transfers as the
schedule lists them deadlocks interleaved 1F1B on NCCL once m > p, so they are grouped by time
(in the spirit of Megatron-LM's ``send_forward_backward_recv_forward_backward``, SC21 §2.2):

1. Time the computes: forward 1 unit, backward 2, transfers free; a compute starts when its rank
   is free and its input has been produced.
2. A transfer happens when its producer ends, on the sender and the receiver alike.
3. On each rank, the transfers of one time form one group (send-next, recv-prev, send-prev,
   recv-next), after the computes starting before that time and before the others.

Groups are in increasing time on every rank and a send and its receive share a time, so by
induction every group completes (checked by :func:`ptdp.layout.pipeline.nccl_model.simulate_nccl`).
In torch 2.13's ``ProcessGroupNCCL::pointToPoint``, operations inside a coalescing group use the
process group's own communicator (a lone ``isend`` may get a two-rank one); ptdp posts no lone
operation, so every group runs on :data:`COMMUNICATOR`, in program order. Tags:
``"act:mb{i}:vs{k}"`` is microbatch i's activation from virtual stage k (to k + 1),
``"grad:mb{i}:vs{k}"`` the gradient of stage k's input (to k - 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ptdp.layout.pipeline.schedule import COMPUTE, Action, build_schedule, peer

#: the NCCL communicator (and stream) every pipeline group runs on: the pipeline group's own
COMMUNICATOR = "pp"
#: a group's operations in this order: send-next, recv-prev, send-prev, recv-next
GROUP_ORDER = ("send_forward", "recv_forward", "send_backward", "recv_backward")
FORWARD_TIME, BACKWARD_TIME = 1, 2


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
    kind: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[Step, ...], ...]:
    """Per pipeline rank, its program: compute :class:`Action` s and :class:`P2PGroup` s in the order
    the runtime runs and posts them (cached per shape, read-only), checked under
    :func:`ptdp.layout.pipeline.nccl_model.simulate_nccl` before being returned.

    Raises ValueError (:func:`ptdp.layout.pipeline.schedule.check_schedule_args`) for a kind that
    cannot run with these sizes, ScheduleError for a program that would deadlock on NCCL.
    """
    from ptdp.layout.pipeline.nccl_model import simulate_nccl

    programs = programs_from_schedule(build_schedule(kind, pp_size, num_microbatches, virtual_stages), virtual_stages)
    simulate_nccl(programs)
    return tuple(tuple(program) for program in programs)


def programs_from_schedule(schedule: list[list[Action]], virtual_stages: int = 1) -> list[list[Step]]:
    """Group the transfers of ``schedule`` (per rank: computes and the transfers around them) by the
    time their producer ends (see the module docstring)."""
    p, v = len(schedule), virtual_stages
    start, end = compute_times(schedule, v)
    programs = []
    for r, acts in enumerate(schedule):
        computes = [a for a in acts if a.kind in COMPUTE]
        groups: dict[int, list[Action]] = {}
        for a in acts:
            if a.kind not in COMPUTE:
                groups.setdefault(end[_producer(a, r, p, v)], []).append(a)
        program: list[Step] = []
        times, i = sorted(groups), 0
        for a in computes:
            while i < len(times) and times[i] <= start[(r, a)]:
                program.append(_group(groups[times[i]], times[i], r, p))
                i += 1
            program.append(a)
        program += [_group(groups[t], t, r, p) for t in times[i:]]
        programs.append(program)
    return programs


def compute_times(schedule: list[list[Action]], virtual_stages: int) -> tuple[dict, dict]:
    """Start and end of every compute, keyed ``(rank, action)``: forward 1 unit, backward 2,
    transfers free. Raises ValueError when the schedule's data dependencies form a cycle."""
    p = len(schedule)
    computes = [[a for a in acts if a.kind in COMPUTE] for acts in schedule]
    start: dict[tuple[int, Action], int] = {}
    end: dict[tuple[int, Action], int] = {}
    pc, clock = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(computes[r]):
                a = computes[r][pc[r]]
                dep = _input_producer(a, r, p, virtual_stages)
                if dep is not None and dep not in end:
                    break
                begin = max(clock[r], end[dep] if dep is not None else 0)
                start[(r, a)] = begin
                clock[r] = end[(r, a)] = begin + (FORWARD_TIME if a.kind == "forward" else BACKWARD_TIME)
                pc[r] += 1
                progress = True
    stuck = [(r, computes[r][pc[r]]) for r in range(p) if pc[r] < len(computes[r])]
    if stuck:
        raise ValueError(
            "the schedule's computes wait on each other: "
            + "; ".join(f"rank {r} at {a.kind} of microbatch {a.microbatch} chunk {a.chunk}" for r, a in stuck)
        )
    return start, end


def virtual_stage(rank: int, chunk: int, pp_size: int) -> int:
    """Virtual stage of model chunk ``chunk`` on pipeline rank ``rank``."""
    return chunk * pp_size + rank


def tag(action: Action, rank: int, pp_size: int) -> str:
    """The tag of a transfer: the same string on the send and on the receive it pairs with."""
    stage = virtual_stage(rank, action.chunk, pp_size)
    if action.kind == "recv_forward":
        return f"act:mb{action.microbatch}:vs{stage - 1}"
    if action.kind == "recv_backward":
        return f"grad:mb{action.microbatch}:vs{stage + 1}"
    return f"{'act' if action.kind == 'send_forward' else 'grad'}:mb{action.microbatch}:vs{stage}"


def _input_producer(a: Action, r: int, p: int, v: int) -> tuple[int, Action] | None:
    """The compute on another virtual stage whose output ``a`` needs (None for the first stage's
    forward and the last stage's backward)."""
    stage = virtual_stage(r, a.chunk, p)
    if a.kind == "forward":
        if stage == 0:
            return None
        return ((r - 1) % p, Action("forward", a.microbatch, (stage - 1) // p))
    if stage == p * v - 1:
        return None
    return ((r + 1) % p, Action("backward", a.microbatch, (stage + 1) // p))


def _producer(a: Action, r: int, p: int, v: int) -> tuple[int, Action]:
    """The compute whose end a transfer waits for: the sender's own compute for a send; for a
    receive, the peer's compute whose output the receiving compute needs."""
    compute = Action(a.kind[5:], a.microbatch, a.chunk)
    if a.kind.startswith("send"):
        return (r, compute)
    producer = _input_producer(compute, r, p, v)
    if producer is None:  # no schedule receives into the first stage's forward or the last's backward
        raise ValueError(f"rank {r}'s {a.kind} of microbatch {a.microbatch}, chunk {a.chunk} has no sender")
    return producer


def _group(actions: list[Action], time: int, r: int, p: int) -> P2PGroup:
    ordered = sorted(actions, key=lambda a: (GROUP_ORDER.index(a.kind), a.microbatch, a.chunk))
    ops = tuple(P2POp(a.kind[:4], peer(a, r, p), tag(a, r, p), a) for a in ordered)
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
