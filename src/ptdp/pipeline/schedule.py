"""Pipeline schedules as pure data: for each pipeline rank, the ordered list of actions it runs.

An :class:`Action` is a forward or backward of one microbatch, or a send/receive of its activation
(``*_forward``, to/from the next/previous stage) or of its gradient (``*_backward``). Consecutive
transfers in a rank's list are posted together by the runtime (``batch_isend_irecv``), which is what
makes the steady state of 1F1B deadlock-free. :func:`check_schedule` proves a schedule correct
without any process: forward before backward, every send matched by the peer's receive of the same
microbatch, no deadlock, and in-flight microbatches within the kind's bound.

Kinds (Narayanan et al. SC21, arXiv:2104.04473, §2.2): ``gpipe`` (all forwards, then all
backwards; up to m microbatches in flight), ``1f1b`` (warm-up of p - r - 1 forwards, then one
forward / one backward; at most p - r in flight on rank r), and ``forward-only`` (evaluation).
Bubble fraction of gpipe and 1f1b: (p - 1) / m.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("forward", "backward")
TRANSFER = ("recv_forward", "send_forward", "recv_backward", "send_backward")
KINDS = ("1f1b", "gpipe", "forward-only")


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's program: ``kind`` on ``microbatch``."""

    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + TRANSFER:
            raise ValueError(f"unknown action kind {self.kind!r}")


def _forward(mb: int, first: bool, last: bool) -> list[Action]:
    acts = [] if first else [Action("recv_forward", mb)]
    acts.append(Action("forward", mb))
    if not last:
        acts.append(Action("send_forward", mb))
    return acts


def _backward(mb: int, first: bool, last: bool) -> list[Action]:
    acts = [] if last else [Action("recv_backward", mb)]
    acts.append(Action("backward", mb))
    if not first:
        acts.append(Action("send_backward", mb))
    return acts


def build_schedule(kind: str, pp_size: int, num_microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered actions of one step with ``num_microbatches`` microbatches.

    Raises ValueError for an unknown kind or non-positive sizes.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {KINDS}")
    if pp_size < 1 or num_microbatches < 1:
        raise ValueError(f"pp_size={pp_size} and num_microbatches={num_microbatches} must be >= 1")
    p, m = pp_size, num_microbatches
    out = []
    for r in range(p):
        first, last = r == 0, r == p - 1
        if kind == "forward-only":
            acts = [a for i in range(m) for a in _forward(i, first, last)]
        elif kind == "gpipe":
            acts = [a for i in range(m) for a in _forward(i, first, last)]
            acts += [a for i in range(m) for a in _backward(i, first, last)]
        else:
            acts = _one_f_one_b(m, p - r - 1, first, last)
        out.append(acts)
    return out


def _one_f_one_b(m: int, warmup: int, first: bool, last: bool) -> list[Action]:
    warmup = min(warmup, m)
    acts = [a for i in range(warmup) for a in _forward(i, first, last)]
    for j in range(m - warmup):
        acts += _forward(warmup + j, first, last)
        acts += _backward(j, first, last)
    for j in range(m - warmup, m):
        acts += _backward(j, first, last)
    return acts


class ScheduleError(ValueError):
    """A schedule that would compute wrongly or deadlock; the message names the rank and action."""


def transfer_batches(actions: list[Action]) -> list[list[Action]]:
    """Split a rank's actions into steps: each compute alone, each run of transfers as one batch."""
    steps: list[list[Action]] = []
    for a in actions:
        if a.kind in TRANSFER and steps and steps[-1][0].kind in TRANSFER:
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


def check_schedule(schedule: list[list[Action]], num_microbatches: int, *, max_in_flight: list[int] | None = None) -> None:
    """Prove ``schedule`` correct by simulation; raises :class:`ScheduleError` otherwise.

    Checks, for every rank: each microbatch forwarded once (and backwarded once, after its forward,
    unless the schedule is forward-only); activations received before the forward that uses them
    and sent after it; gradients likewise; every send matched by the neighbour's receive of the
    same microbatch, in order; the whole pipeline completes when transfers only finish once both
    sides posted them (no deadlock); and at most ``max_in_flight[r]`` microbatches are between
    their forward and backward on rank r.
    """
    p = len(schedule)
    for r, acts in enumerate(schedule):
        _check_rank_order(r, acts, num_microbatches, p, max_in_flight[r] if max_in_flight else None)
    _simulate(schedule)


def _check_rank_order(r: int, acts: list[Action], m: int, p: int, bound: int | None) -> None:
    seen: dict[tuple[str, int], int] = {}
    in_flight = 0
    for pos, a in enumerate(acts):
        key = (a.kind, a.microbatch)
        if key in seen:
            raise ScheduleError(f"rank {r}: {a.kind} of microbatch {a.microbatch} appears twice")
        seen[key] = pos
        if not 0 <= a.microbatch < m:
            raise ScheduleError(f"rank {r}: microbatch {a.microbatch} outside [0, {m})")
        needs = {
            "forward": [] if r == 0 else ["recv_forward"],
            "send_forward": ["forward"],
            "backward": ["forward"] + ([] if r == p - 1 else ["recv_backward"]),
            "send_backward": ["backward"],
        }.get(a.kind, [])
        for need in needs:
            if (need, a.microbatch) not in seen:
                raise ScheduleError(f"rank {r}: {a.kind} of microbatch {a.microbatch} before its {need}")
        in_flight += {"forward": 1, "backward": -1}.get(a.kind, 0)
        if bound is not None and in_flight > bound:
            raise ScheduleError(f"rank {r}: {in_flight} microbatches in flight > bound {bound}")
    has_backward = any(a.kind == "backward" for a in acts)
    for i in range(m):
        for kind in ("forward", "backward") if has_backward else ("forward",):
            if (kind, i) not in seen:
                raise ScheduleError(f"rank {r}: microbatch {i} has no {kind}")


def _simulate(schedule: list[list[Action]]) -> None:
    """Run all ranks together; a transfer batch completes only when every peer posted its half."""
    p = len(schedule)
    steps = [transfer_batches(acts) for acts in schedule]
    pc = [0] * p
    posted: dict[tuple[int, int, str, str], list[int]] = {}  # (src, dst, dir, side) -> microbatches
    posted_upto = [-1] * p

    def channel(r: int, a: Action) -> tuple[tuple[int, int, str, str], tuple[int, int, str, str], int]:
        peer = r + 1 if a.kind in ("send_forward", "recv_backward") else r - 1
        if not 0 <= peer < p:
            raise ScheduleError(f"rank {r}: {a.kind} of microbatch {a.microbatch} has no peer")
        direction = "fwd" if a.kind.endswith("forward") else "bwd"
        src, dst = (r, peer) if a.kind.startswith("send") else (peer, r)
        side = "send" if a.kind.startswith("send") else "recv"
        other = "recv" if side == "send" else "send"
        return (src, dst, direction, side), (src, dst, direction, other), peer

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if step[0].kind in COMPUTE:
                    pc[r] += 1
                    progress = True
                    continue
                if posted_upto[r] < pc[r]:
                    for a in step:
                        mine, _, _ = channel(r, a)
                        posted.setdefault(mine, []).append(a.microbatch)
                    posted_upto[r] = pc[r]
                    progress = True
                if not all(_matched(posted, channel(r, a), a) for a in step):
                    break
                pc[r] += 1
                progress = True
    stuck = [(r, steps[r][pc[r]]) for r in range(p) if pc[r] < len(steps[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {r} waits in {[(a.kind, a.microbatch) for a in s]}" for r, s in stuck))


def _matched(posted, chans, a: Action) -> bool:
    mine, other, _ = chans
    mine_list, other_list = posted.get(mine, []), posted.get(other, [])
    # the k-th posted transfer on a channel pairs with the k-th posted on the other side
    k = len(mine_list) - 1 - mine_list[::-1].index(a.microbatch)
    if k >= len(other_list):
        return False
    if other_list[k] != a.microbatch:
        raise ScheduleError(
            f"{a.kind} of microbatch {a.microbatch} is paired with microbatch {other_list[k]} by the peer"
        )
    return True
