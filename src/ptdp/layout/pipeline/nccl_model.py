"""NCCL's point-to-point rules as a model, and a proof by simulation that a set of pipeline programs
cannot deadlock under them (pure, no torch, no process).

The model (what ``ProcessGroupNCCL`` and NCCL do with ``batch_isend_irecv`` groups of messages
larger than NCCL's internal buffers, i.e. real activations):

- **Ordered groups per communicator**: each group runs on its communicator's stream; a rank's
  groups of one communicator run one after another in posting order. A group *starts* when the
  rank has reached it and the rank's previous group on that communicator has completed.
- **Rendezvous, no buffering**: a send and its receive move data only while both of their groups
  have started and not completed; a group completes when every operation in it has moved its data.
  No send completes before its receive is running.
- **Matching by order**: on one communicator, the n-th send from rank a to rank b pairs with the
  n-th receive on b from a (NCCL has no tags). The tags of the model are there to check that this
  order pairs each message with the buffer meant for it: a pair with different tags is an error
  (silent corruption on a GPU), as is a send or receive with no partner.
- **A rank runs its program in order**: a compute can only run after the groups before it
  completed (the runtime makes the compute stream wait for each group it needs, and posts groups in
  program order, so nothing a rank does can overtake a group that has not started). This is the
  strictest host model: it waits for every group, so any program deadlock-free under it is
  deadlock-free with fewer waits (the waits it adds only delay groups that the stream order
  already serialises).

:func:`simulate_nccl` runs every rank until all programs are done, or raises
:class:`ScheduleError` naming each stuck rank and what it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that would compute wrongly or deadlock; the message names the rank and action."""


@dataclass(frozen=True)
class Op:
    """One operation of a group in the model's terms (anything with ``op``, ``peer`` and ``tag``)."""

    op: str
    peer: int
    tag: str


def simulate_nccl(
    programs: list[list],
    *,
    communicator=lambda step: step.communicator,
    ops=lambda step: step.ops,
    is_group=lambda step: hasattr(step, "ops"),
) -> int:
    """Run ``programs`` (per rank: steps, where a group has ``communicator`` and ``ops`` with ``op``,
    ``peer`` and ``tag``, and anything else is a compute) under NCCL's rules.

    Returns the number of rounds the simulation took (each round starts every group that can start
    and completes every group whose operations all met their partners).

    Raises:
        ScheduleError: a deadlock (naming each stuck rank, its group and the partner it waits for),
            a send paired with a receive of another tag, or an operation without a partner.
    """
    partner = _pair(programs, communicator, ops, is_group)
    p = len(programs)
    pc = [0] * p
    moved: set[tuple[int, int, int]] = set()  # (rank, step index, op index)
    rounds = 0
    while True:
        rounds += 1
        for r in range(p):  # computes need no peer
            while pc[r] < len(programs[r]) and not is_group(programs[r][pc[r]]):
                pc[r] += 1
        running = {(r, pc[r]) for r in range(p) if pc[r] < len(programs[r])}
        if not running:
            return rounds
        for r, i in running:
            for j, _ in enumerate(ops(programs[r][i])):
                q, qi, qj = partner[(r, i, j)]
                if (q, qi) in running:
                    moved.add((r, i, j))
        done = [(r, i) for r, i in running if all((r, i, j) in moved for j in range(len(ops(programs[r][i]))))]
        if not done:
            raise ScheduleError(
                "deadlock under NCCL's rules (ordered groups, rendezvous): "
                + "; ".join(_stuck(programs, r, i, partner, running, ops) for r, i in sorted(running))
            )
        for r, _ in done:
            pc[r] += 1


def _pair(programs, communicator, ops, is_group) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """For each operation ``(rank, step, op index)``, its partner's, matched by order per
    (communicator, sender, receiver); ScheduleError on a tag mismatch or a missing partner."""
    queues: dict[tuple, list[tuple[int, int, int, str]]] = {}
    for r, program in enumerate(programs):
        for i, step in enumerate(program):
            if not is_group(step):
                continue
            for j, o in enumerate(ops(step)):
                if o.peer == r or not 0 <= o.peer < len(programs):
                    raise ScheduleError(f"rank {r}: {o.op} {o.tag} names peer {o.peer}")
                src, dst = (r, o.peer) if o.op == "send" else (o.peer, r)
                queues.setdefault((communicator(step), src, dst, o.op), []).append((r, i, j, o.tag))
    partner = {}
    for (comm, src, dst, kind), mine in queues.items():
        if kind != "send":
            if (comm, src, dst, "send") not in queues:
                raise ScheduleError(f"rank {dst} receives {mine[0][3]} from rank {src} on {comm}, which never sends")
            continue
        theirs = queues.get((comm, src, dst, "recv"), [])
        if len(mine) != len(theirs):
            raise ScheduleError(
                f"on communicator {comm}, rank {src} sends {len(mine)} messages to rank {dst}, "
                f"which receives {len(theirs)} from it"
            )
        for n, (sent, received) in enumerate(zip(mine, theirs)):
            if sent[3] != received[3]:
                raise ScheduleError(
                    f"on communicator {comm}, send #{n} from rank {src} to rank {dst} carries "
                    f"{sent[3]} but rank {dst}'s receive #{n} from rank {src} expects {received[3]}"
                )
            partner[sent[:3]], partner[received[:3]] = received[:3], sent[:3]
    return partner


def _stuck(programs, r, i, partner, running, ops) -> str:
    at = dict(running)
    waits = []
    for j, o in enumerate(ops(programs[r][i])):
        q, qi, _ = partner[(r, i, j)]
        if (q, qi) not in running:
            where = f"at step {at[q]}" if q in at else "finished"
            waits.append(f"{o.op} {o.tag} waits for rank {q}'s step {qi} (rank {q} is {where})")
    return f"rank {r} step {i}: " + ", ".join(waits or ["(its partners are running)"])
