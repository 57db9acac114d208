"""NCCL's point-to-point rules as a model, and a simulation proving that pipeline programs cannot
deadlock under them (pure, no torch, no process).

The model (``ProcessGroupNCCL`` and NCCL with ``batch_isend_irecv`` groups of messages larger than
NCCL's internal buffers, i.e. real activations):

- **Ordered groups per communicator**: a rank's groups on one communicator run in posting order; a
  group starts when the rank has reached it and its previous group there has completed.
- **Rendezvous, no buffering**: a send and its receive move data only while both groups run; a
  group completes when all its operations have moved their data.
- **Matching by order**: the n-th send from a to b pairs with the n-th receive on b from a (NCCL
  has no tags); the model's tags check that this pairing is the intended one.
- **In-order ranks**: a compute runs only after the groups before it completed (the strictest host
  model, so a program deadlock-free under it is deadlock-free with fewer waits).

:func:`simulate_nccl` raises :class:`ScheduleError` naming each stuck rank and what it waits for.
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
    """Run ``programs`` (per rank: steps; a group has ``communicator`` and ``ops`` with ``op``, ``peer``
    and ``tag``, anything else is a compute) under NCCL's rules; returns the number of rounds.

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
