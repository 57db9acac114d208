"""Pipeline schedules as pure data: for each pipeline rank, the ordered list of actions it runs.

An :class:`Action` is a compute on microbatch ``i`` of model chunk ``c``, a send/receive of an
activation (``*_forward``) or a gradient (``*_backward``), or a hand-over between two chunks of the
same rank. Computes: ``forward`` (F), ``backward`` (the whole backward, B + W), ``backward_input``
(B: the gradient of the chunk's input, sent on at once) and ``backward_weight`` (W: the weight
gradients of the same microbatch and chunk, run later from the closures B queued). Which virtual
stage chunk ``c`` of rank ``r`` is: :mod:`ptdp.layout.pipeline.placement`. Grouping the transfers
into ``batch_isend_irecv`` calls is :mod:`ptdp.layout.pipeline.program`.

Kinds (Narayanan et al. SC21, arXiv:2104.04473, §2.2):

- ``gpipe``: all forwards, then all backwards; m microbatches in flight; bubble (p - 1) / m.
- ``1f1b``: p - r - 1 warm-up forwards on rank r, then one forward / one backward; at most
  min(p - r, m) in flight; bubble (p - 1) / m.
- ``interleaved-1f1b``: v chunks per rank, microbatches in groups of p through the chunks in
  turn; warm-up 2 (p - r - 1) + (v - 1) p forwards; bubble (p - 1) / (v m); needs m % p == 0.
- ``forward-only``: evaluation; on the V placement (a model trained with ``zb-v`` or
  ``dualpipev``) every chunk-0 forward, then every chunk-1 forward.

Zero-bubble kinds (B and W apart; :mod:`ptdp.layout.pipeline.zero_bubble`): ``zb-h1`` and
``zb-h2`` (one chunk per rank), ``zb-v`` (two chunks per rank on the V placement); ``dualpipev``
(:mod:`ptdp.layout.pipeline.dualpipe`: the V placement, overlapped forward and backward pairs,
needs m >= 2p); ``auto`` (:mod:`ptdp.layout.pipeline.auto`: built from F, B, W and p2p times
within a memory limit, one chunk per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.layout.pipeline.auto import auto_orders
from ptdp.layout.pipeline.dualpipe import dualpipev_order
from ptdp.layout.pipeline.placement import placement_of, stage_owner, virtual_stage
from ptdp.layout.pipeline.timing import StageTimes
from ptdp.layout.pipeline.zero_bubble import zb_h1_order, zb_h2_order, zb_v_order

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
#: the computes that produce the gradient of the chunk's input (what ``send_backward`` sends)
INPUT_GRADIENT = ("backward", "backward_input")
TRANSFER = ("recv_forward", "send_forward", "recv_backward", "send_backward")
#: a receive satisfied on the same rank, where two consecutive virtual stages share it (the V
#: placement's turn at rank p - 1): ``handover_forward`` of (i, c) makes the output of chunk c - 1's
#: forward chunk c's input, ``handover_backward`` of (i, c) makes the gradient of chunk c + 1's
#: input chunk c's output gradient. The runtime moves the tensor (detached, as a received one
#: would be) and posts no operation.
HANDOVER = ("handover_forward", "handover_backward")
KINDS = ("1f1b", "gpipe", "interleaved-1f1b", "forward-only", "zb-h1", "zb-h2", "zb-v", "dualpipev", "auto")
#: the kinds whose order each rank's function gives: (p, m, r) -> [(kind, microbatch, chunk)]
SPLIT_ORDERS = {"zb-h1": zb_h1_order, "zb-h2": zb_h2_order, "zb-v": zb_v_order, "dualpipev": dualpipev_order}


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's program: ``kind`` on ``microbatch`` of model ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + TRANSFER + HANDOVER:
            raise ValueError(f"unknown action kind {self.kind!r}")


def check_schedule_args(
    kind: str, pp_size: int, num_microbatches: int, virtual_stages: int, placement: str | None = None
) -> None:
    """ValueError naming the numbers unless the kind can run with them (``placement``: forward-only's,
    default looped)."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {KINDS}")
    p, m, v = pp_size, num_microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp_size={p}, num_microbatches={m} and virtual_stages={v} must be >= 1")
    if kind in ("gpipe", "1f1b", "zb-h1", "zb-h2", "auto") and v != 1:
        raise ValueError(
            f"the {kind} schedule runs one model chunk per rank; virtual_stages={v} needs interleaved-1f1b"
        )
    if placement_of(kind) == "v" and v != 2:
        raise ValueError(f"the {kind} schedule runs two model chunks per rank in a V; virtual_stages={v} must be 2")
    if kind == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs num_microbatches >= 2 * pp: pp={p}, num_microbatches={m}")
    if kind == "interleaved-1f1b" and (p < 2 or m % p):
        raise ValueError(f"interleaved-1f1b needs pp >= 2 and num_microbatches % pp == 0: pp={p}, num_microbatches={m}")
    if kind == "forward-only" and placement == "v":
        if v != 2:
            raise ValueError(f"forward-only on the V placement runs two model chunks per rank; virtual_stages={v}")
    elif kind == "forward-only" and v > 1 and (p < 2 or m % p):
        raise ValueError(
            f"forward-only over {v} chunks needs pp >= 2 and num_microbatches % pp == 0: pp={p}, num_microbatches={m}"
        )


def schedule_placement(kind: str, placement: str | None = None) -> str:
    """The placement ``kind`` runs on: its own (:func:`~ptdp.layout.pipeline.placement.placement_of`),
    or for ``forward-only`` the training schedule's ``placement`` (default looped)."""
    return "v" if kind == "forward-only" and placement == "v" else placement_of(kind)


def build_schedule(
    kind: str,
    pp_size: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    times: StageTimes | None = None,
    memory_limit: int | None = None,
    placement: str | None = None,
) -> list[list[Action]]:
    """Per pipeline rank, the ordered actions of one step. ``auto`` only: the F, B, W and p2p
    ``times`` (default all equal, p2p free) and the ``memory_limit`` in microbatches of
    activations per rank (default pp_size, the 1F1B peak). ``forward-only`` only: the
    ``placement`` of the training schedule (default looped).

    Raises ValueError (see :func:`check_schedule_args`) for a kind that cannot run with these sizes.
    """
    placement = schedule_placement(kind, placement)
    forward_v = kind == "forward-only" and placement == "v"
    check_schedule_args(kind, pp_size, num_microbatches, virtual_stages, "v" if forward_v else None)
    p, m, v = pp_size, num_microbatches, virtual_stages
    if forward_v:
        orders = [[("forward", i, c) for c in range(2) for i in range(m)] for _ in range(p)]
    elif kind == "auto":
        orders = auto_orders(p, m, times or StageTimes(), p if memory_limit is None else memory_limit)
    else:
        orders = [_compute_order(kind, p, m, v, r) for r in range(p)]
    return [with_transfers(order, r, p, v, placement) for r, order in enumerate(orders)]


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
    if kind in SPLIT_ORDERS:
        return SPLIT_ORDERS[kind](p, m, r)
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


def with_transfers(
    order: list[tuple[str, int, int]], r: int, p: int, v: int, placement: str = "looped"
) -> list[Action]:
    """Rank r's actions from its computes ``(kind, microbatch, chunk)`` in order: the receive (or
    the hand-over, from a chunk of the same rank) before each compute that needs one, the send
    after each compute whose consumer is on another rank."""
    last = p * v - 1
    acts: list[Action] = []
    for kind, mb, c in order:
        stage = virtual_stage(r, c, p, placement)
        if kind == "forward":
            before, after = stage - 1 if stage > 0 else None, stage + 1 if stage < last else None
        elif kind in INPUT_GRADIENT:
            before, after = stage + 1 if stage < last else None, stage - 1 if stage > 0 else None
        else:  # backward_weight: its inputs are the rank's own
            before = after = None
        direction = "forward" if kind == "forward" else "backward"
        if before is not None:
            local = stage_owner(before, p, placement)[0] == r
            acts.append(Action(f"{'handover' if local else 'recv'}_{direction}", mb, c))
        acts.append(Action(kind, mb, c))
        if after is not None and stage_owner(after, p, placement)[0] != r:
            acts.append(Action(f"send_{direction}", mb, c))
    return acts


def peer(action: Action, rank: int, pp_size: int, placement: str = "looped") -> int:
    """The pipeline rank a transfer goes to or comes from: the owner of the next virtual stage for
    ``send_forward`` and ``recv_backward``, of the previous one otherwise."""
    after = action.kind in ("send_forward", "recv_backward")
    return stage_owner(boundary(action, rank, pp_size, placement) + after, pp_size, placement)[0]


def boundary(action: Action, rank: int, pp_size: int, placement: str = "looped") -> int:
    """Which virtual-stage boundary a transfer crosses: boundary k is between virtual stages k and
    k + 1. A send and the receive that pairs with it name the same boundary and microbatch."""
    stage = virtual_stage(rank, action.chunk, pp_size, placement)
    return stage if action.kind in ("send_forward", "recv_backward") else stage - 1
