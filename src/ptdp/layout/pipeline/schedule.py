"""Pipeline schedules as pure data: for each pipeline rank, the ordered list of actions it runs.

An :class:`Action` is a forward or backward of microbatch ``i`` on model chunk ``c`` (chunk ``c``
of rank ``r`` is virtual stage ``c * p + r``), or a send/receive of an activation (``*_forward``)
or a gradient (``*_backward``). Grouping into ``batch_isend_irecv`` calls is
:mod:`ptdp.layout.pipeline.program`.

Kinds (Narayanan et al. SC21, arXiv:2104.04473, §2.2):

- ``gpipe``: all forwards, then all backwards; m microbatches in flight; bubble (p - 1) / m.
- ``1f1b``: p - r - 1 warm-up forwards on rank r, then one forward / one backward; at most
  min(p - r, m) in flight; bubble (p - 1) / m.
- ``interleaved-1f1b``: v chunks per rank, microbatches in groups of p through the chunks in
  turn; warm-up 2 (p - r - 1) + (v - 1) p forwards; bubble (p - 1) / (v m); needs m % p == 0.
- ``forward-only``: evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("forward", "backward")
TRANSFER = ("recv_forward", "send_forward", "recv_backward", "send_backward")
KINDS = ("1f1b", "gpipe", "interleaved-1f1b", "forward-only")


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's program: ``kind`` on ``microbatch`` of model ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + TRANSFER:
            raise ValueError(f"unknown action kind {self.kind!r}")


def check_schedule_args(kind: str, pp_size: int, num_microbatches: int, virtual_stages: int) -> None:
    """ValueError naming the numbers unless the kind can run with them."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {KINDS}")
    p, m, v = pp_size, num_microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp_size={p}, num_microbatches={m} and virtual_stages={v} must be >= 1")
    if kind in ("gpipe", "1f1b") and v != 1:
        raise ValueError(
            f"the {kind} schedule runs one model chunk per rank; virtual_stages={v} needs interleaved-1f1b"
        )
    if kind == "interleaved-1f1b" and (p < 2 or m % p):
        raise ValueError(f"interleaved-1f1b needs pp >= 2 and num_microbatches % pp == 0: pp={p}, num_microbatches={m}")
    if kind == "forward-only" and v > 1 and (p < 2 or m % p):
        raise ValueError(
            f"forward-only over {v} chunks needs pp >= 2 and num_microbatches % pp == 0: pp={p}, num_microbatches={m}"
        )


def build_schedule(kind: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Per pipeline rank, the ordered actions of one step.

    Raises ValueError (see :func:`check_schedule_args`) for a kind that cannot run with these sizes.
    """
    check_schedule_args(kind, pp_size, num_microbatches, virtual_stages)
    p, m, v = pp_size, num_microbatches, virtual_stages
    return [_with_transfers(_compute_order(kind, p, m, v, r), r, p, v) for r in range(p)]


def forward_item(k: int, p: int, v: int) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward of a rank: groups of p microbatches go through
    chunk 0, 1, ..., v-1 in turn."""
    group, within = divmod(k, p * v)
    return group * p + within % p, within // p


def backward_item(k: int, p: int, v: int) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th backward: like :func:`forward_item`, chunks in reverse."""
    mb, chunk = forward_item(k, p, v)
    return mb, v - 1 - chunk


def warmup_forwards(kind: str, p: int, m: int, v: int, r: int) -> int:
    """Forwards rank r runs before its first backward."""
    total = m * v
    if kind == "gpipe" or kind == "forward-only":
        return total
    if kind == "1f1b" or v == 1:
        return min(p - r - 1, m)
    return min(2 * (p - r - 1) + (v - 1) * p, total)


def _compute_order(kind: str, p: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    total = m * v
    fwd = [("forward", *forward_item(k, p, v)) for k in range(total)]
    if kind == "forward-only":
        return fwd
    bwd = [("backward", *backward_item(k, p, v)) for k in range(total)]
    warmup = warmup_forwards(kind, p, m, v, r)
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup :]


def _with_transfers(order: list[tuple[str, int, int]], r: int, p: int, v: int) -> list[Action]:
    """Insert the receive before and the send after each compute that needs one."""
    first_stage = lambda c: r == 0 and c == 0  # noqa: E731  (virtual stage 0: has the tokens)
    last_stage = lambda c: r == p - 1 and c == v - 1  # noqa: E731  (last virtual stage: the loss)
    acts: list[Action] = []
    for kind, mb, c in order:
        if kind == "forward":
            if not first_stage(c):
                acts.append(Action("recv_forward", mb, c))
            acts.append(Action("forward", mb, c))
            if not last_stage(c):
                acts.append(Action("send_forward", mb, c))
        else:
            if not last_stage(c):
                acts.append(Action("recv_backward", mb, c))
            acts.append(Action("backward", mb, c))
            if not first_stage(c):
                acts.append(Action("send_backward", mb, c))
    return acts


def peer(action: Action, rank: int, pp_size: int) -> int:
    """The pipeline rank a transfer goes to or comes from (wrapping between chunks)."""
    if action.kind in ("send_forward", "recv_backward"):
        return (rank + 1) % pp_size
    return (rank - 1) % pp_size


def boundary(action: Action, rank: int, pp_size: int) -> int:
    """Which virtual-stage boundary a transfer crosses: boundary k is between virtual stages k and
    k + 1. A send and the receive that pairs with it name the same boundary and microbatch."""
    stage = action.chunk * pp_size + rank
    return stage if action.kind in ("send_forward", "recv_backward") else stage - 1
