"""The one thin layer through which every collective and point-to-point transfer goes, counted.

Each call is recorded in its :class:`AxisGroup`'s :class:`CommStats` as (axis, op, tag) -> calls,
elements, bytes; the elements are what this rank puts in (an all-gather: this rank's part). A call
on an axis of size 1 is a no-op, not counted. Axes: ``tp``, ``cp``, ``pp``, ``dp`` (also the dp x cp
gradient group), ``ep`` (the expert-parallel token exchange), ``embedding`` (first and last stage,
tied embedding), ``world``.

A call or ``wait()`` that fails raises :class:`~ptdp.engine.activity.CollectiveError` naming this
rank, its phase and iteration, the axis, the operation and the ranks waited for.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ptdp.engine.activity import CollectiveError, collective_error, is_timeout


@dataclass
class CommCount:
    calls: int = 0
    numel: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Host seconds inside the calls, when their :class:`CommStats` ``clock`` is on."""


class CommStats:
    """Counts of communication per (axis, op, tag); ``tag`` says which code site issued it.

    ``p2p_log``: None, or a list to which :func:`post` appends each batch of point-to-point
    operations as ``(axis, [(kind, peer, label), ...])`` in posting order (what the pipeline
    runtime really posts, comparable with ``ptdp schedule --json``). ``clock``: when True, the host
    seconds of each :func:`all_to_all` are added to its count; gloo's calls on CPU tensors return
    once the exchange is done (on NCCL they would time the launch alone)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], CommCount] = defaultdict(CommCount)
        self.p2p_log: list | None = None
        self.clock = False

    def record(self, axis: str, op: str, tensor: torch.Tensor, tag: str) -> None:
        c = self._counts[(axis, op, tag)]
        c.calls += 1
        c.numel += tensor.numel()
        c.bytes += tensor.numel() * tensor.element_size()

    def add_seconds(self, axis: str, op: str, tag: str, seconds: float) -> None:
        self._counts[(axis, op, tag)].seconds += seconds

    def reset(self) -> None:
        self._counts.clear()

    def total(self, axis: str | None = None, op: str | None = None, tag: str | None = None) -> CommCount:
        """Sum of the counts matching every given key (None matches anything)."""
        out = CommCount()
        for (a, o, t), c in self._counts.items():
            if (axis is None or a == axis) and (op is None or o == op) and (tag is None or t == tag):
                out.calls += c.calls
                out.numel += c.numel
                out.bytes += c.bytes
                out.seconds += c.seconds
        return out

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"axis/op/tag": {"calls", "numel", "bytes"}}``, for logs and JSON."""
        return {
            "/".join(k): {"calls": c.calls, "numel": c.numel, "bytes": c.bytes} for k, c in sorted(self._counts.items())
        }


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """One process group along one axis, as seen by this process.

    ``name``: the axis its calls are counted on; ``ranks``: global ranks in group order; ``rank``:
    this process's index in ``ranks``; ``group``: the torch group (None at size 1); ``stats``: the
    process's shared counts; ``timeout_s``: the group's timeout, for error messages (None: unknown).
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None
    stats: CommStats
    timeout_s: float | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls, name: str, global_rank: int = 0, stats: CommStats | None = None) -> AxisGroup:
        """A group of one process: every call on it is a local no-op."""
        return cls(name, (global_rank,), 0, None, stats if stats is not None else CommStats())


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _all_gather_single():
    """``dist.all_gather_single`` where this torch has it, else ``all_gather_into_tensor``: the
    same collective under its older name (deprecated once the new one exists)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    """``dist.reduce_scatter_single`` where this torch has it, else ``reduce_scatter_tensor``."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _failure(err: RuntimeError, axis: AxisGroup, op: str, peer: int | None = None) -> CollectiveError:
    rank = axis.ranks[axis.rank]
    silent = _silent_ranks(rank, axis.timeout_s) if is_timeout(err) else None
    return collective_error(
        err,
        rank=rank,
        axis=axis.name,
        op=op,
        ranks=axis.ranks,
        silent=silent,
        peer=None if peer is None else axis.ranks[peer],
        timeout_s=axis.timeout_s,
    )


def _silent_ranks(rank: int, timeout_s: float | None) -> list[int] | None:
    """After a timeout on this rank: the ranks of the world that do not report one too.

    Each timed-out rank marks itself in the default group's store and waits until all ranks but
    one have (or a grace of a quarter of the timeout, 2 to 30 s); the unmarked ranks are returned
    (the one that stopped responding is the one others wait for). None when the store fails.
    """
    grace = min(30.0, max(2.0, 0.25 * (timeout_s or 0.0)))
    key = f"ptdp/timed_out/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
        first = not store.check([f"{key}/{rank}"])  # counted once, however many of its calls fail
        store.set(f"{key}/{rank}", "1")
        count, deadline = store.add(f"{key}/count", int(first)), time.monotonic() + grace
        while count < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(f"{key}/count", 0)
        return [r for r in range(world) if not store.check([f"{key}/{r}"])]
    except Exception:
        return None


def _call(axis: AxisGroup, what: str, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, its failure raised as a :class:`CollectiveError` about operation
    ``what``; an async op's handle wrapped so that its ``wait()`` does the same."""
    try:
        work = fn(*args, **kwargs)
    except RuntimeError as err:
        raise _failure(err, axis, what) from err
    return _Work(work, axis, what) if kwargs.get("async_op") else work


class _Work:
    """The handle of a started collective or transfer; ``wait()`` raises :class:`CollectiveError`."""

    __slots__ = ("work", "axis", "op", "peer")

    def __init__(self, work, axis: AxisGroup, op: str, peer: int | None = None) -> None:
        self.work, self.axis, self.op, self.peer = work, axis, op, peer

    def wait(self) -> bool:
        try:
            return self.work.wait()
        except RuntimeError as err:
            raise _failure(err, self.axis, self.op, self.peer) from err


def all_reduce(tensor: torch.Tensor, axis: AxisGroup, *, op: str = "sum", tag: str = "") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``axis`` (``op`` in sum/max/min); returns it."""
    if axis.size == 1:
        return tensor
    axis.stats.record(axis.name, "all_reduce", tensor, tag)
    _call(axis, "all_reduce", dist.all_reduce, tensor, op=_REDUCE_OPS[op], group=axis.group)
    return tensor


class _Done:
    """The handle of a collective that did not need to run (an axis of size 1)."""

    def wait(self) -> bool:
        return True


class Handle(Protocol):
    """A started collective: ``wait()`` finishes it (a wrapped ``torch.distributed`` work, which
    raises :class:`CollectiveError`, or :class:`_Done` on an axis of size 1)."""

    def wait(self) -> bool: ...


def all_reduce_async(tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> Handle:
    """Start a sum all-reduce of ``tensor`` in place; returns a handle to ``wait()`` on."""
    if axis.size == 1:
        return _Done()
    axis.stats.record(axis.name, "all_reduce", tensor, tag)
    return _call(axis, "all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)


def reduce_scatter_async(output: torch.Tensor, tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> Handle:
    """Start a sum reduce-scatter: rank i of ``axis`` gets the i-th of ``axis.size`` equal chunks
    of the sum of ``tensor`` (``tensor.numel()`` elements sent) in ``output``."""
    if axis.size == 1:
        output.copy_(tensor)
        return _Done()
    axis.stats.record(axis.name, "reduce_scatter", tensor, tag)
    return _call(axis, "reduce_scatter", _reduce_scatter_single(), output, tensor, group=axis.group, async_op=True)


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> Handle:
    """Start an all-gather of every rank's ``tensor`` into ``output`` (rank order, concatenated);
    counted as the ``tensor.numel()`` elements this rank contributes."""
    if axis.size == 1:
        output.copy_(tensor)
        return _Done()
    axis.stats.record(axis.name, "all_gather", tensor, tag)
    return _call(axis, "all_gather", _all_gather_single(), output, tensor, group=axis.group, async_op=True)


def all_gather_along(tensor: torch.Tensor, axis: AxisGroup, *, dim: int, tag: str = "") -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along tensor dim ``dim`` in rank order: per rank
    ``[..., n, ...]`` in, ``[..., axis.size * n, ...]`` out (a new contiguous tensor; ``tensor``
    itself on an axis of size 1). Counted as the ``tensor.numel()`` elements this rank
    contributes, as :func:`all_gather_async`."""
    if axis.size == 1:
        return tensor
    dim = dim % tensor.dim()
    part = tensor.contiguous()
    out = part.new_empty((axis.size * part.shape[0], *part.shape[1:]))  # rank blocks along dim 0
    axis.stats.record(axis.name, "all_gather", part, tag)
    _call(axis, "all_gather", _all_gather_single(), out, part, group=axis.group)
    return out.unflatten(0, (axis.size, part.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_along(tensor: torch.Tensor, axis: AxisGroup, *, dim: int, tag: str = "") -> torch.Tensor:
    """Sum of every rank's ``tensor``, of which rank i keeps the i-th of ``axis.size`` equal
    chunks along tensor dim ``dim``: per rank ``[..., n, ...]`` in, ``[..., n / axis.size, ...]``
    out (a new contiguous tensor; ``tensor`` itself on an axis of size 1). Counted as the
    ``tensor.numel()`` elements put in, as :func:`reduce_scatter_async`."""
    if axis.size == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % axis.size:
        raise ValueError(
            f"reduce-scatter along dim {dim} of {tuple(tensor.shape)} over {axis.size} ranks: "
            f"{tensor.shape[dim]} is not divisible by {axis.size}"
        )
    chunks = tensor.unflatten(dim, (axis.size, tensor.shape[dim] // axis.size)).movedim(dim, 0).contiguous()
    out = chunks.new_empty(chunks.shape[1:])
    axis.stats.record(axis.name, "reduce_scatter", tensor, tag)
    _call(axis, "reduce_scatter", _reduce_scatter_single(), out, chunks.flatten(0, 1), group=axis.group)
    return out


def all_to_all(
    tensor: torch.Tensor, axis: AxisGroup, *, in_splits: list[int], out_splits: list[int], tag: str = ""
) -> torch.Tensor:
    """Rows of ``tensor`` (dim 0) exchanged over ``axis``: this rank sends its next ``in_splits[j]``
    rows to rank j and receives ``out_splits[j]`` rows from rank j, in rank order (splits may be 0
    and differ between ranks; ``out_splits`` must equal what the peers send). Per rank
    ``[sum(in_splits), ...]`` in, ``[sum(out_splits), ...]`` out (a new tensor; ``tensor`` itself on an
    axis of size 1). Counted as the ``tensor.numel()`` elements this rank sends, its own included;
    timed with the host clock when ``axis.stats.clock``."""
    if axis.size == 1:
        return tensor
    part = tensor.contiguous()
    out = part.new_empty((sum(out_splits), *part.shape[1:]))
    axis.stats.record(axis.name, "all_to_all", part, tag)
    start = time.perf_counter() if axis.stats.clock else None
    _call(
        axis,
        "all_to_all",
        dist.all_to_all_single,
        out,
        part,
        output_split_sizes=list(out_splits),
        input_split_sizes=list(in_splits),
        group=axis.group,
    )
    if start is not None:
        axis.stats.add_seconds(axis.name, "all_to_all", tag, time.perf_counter() - start)
    return out


@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer: ``kind`` is "send" or "recv", ``peer`` an index in the axis,
    ``tag`` tells apart messages between the same two ranks (gloo honours it; NCCL matches by order),
    ``label`` names the message (the pipeline program's tag, e.g. ``"act:mb3:vs1"``) for logs."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    label: str = ""


def post(transfers: list[P2P], axis: AxisGroup, *, tag: str = "", defer: bool = False) -> list | None:
    """Post ``transfers`` at once (``batch_isend_irecv``) without waiting; returns one work handle
    per transfer, or None when the backend coalesces the batch into one handle (NCCL), in which case
    everything has already been waited for. With ``defer`` a coalesced batch's one handle is
    returned (a list of one) instead, to be waited for later: work queued in between overlaps the
    transfers (on NCCL its ``wait()`` only makes the current stream wait, the host does not)."""
    if not transfers:
        return []
    ops = []
    for t in transfers:
        if not 0 <= t.peer < axis.size or t.peer == axis.rank:
            raise ValueError(f"bad {t.kind} peer {t.peer} on axis {axis.name} of size {axis.size}")
        axis.stats.record(axis.name, t.kind, t.tensor, tag)
        fn = dist.isend if t.kind == "send" else dist.irecv
        ops.append(dist.P2POp(fn, t.tensor, group=axis.group, tag=t.tag, group_peer=t.peer))
    if axis.stats.p2p_log is not None:
        axis.stats.p2p_log.append((axis.name, [(t.kind, t.peer, t.label) for t in transfers]))
    works = _call(axis, transfers[0].kind if len(transfers) == 1 else "send/recv", dist.batch_isend_irecv, ops)
    if len(works) != len(ops):
        if defer:
            return [_Work(work, axis, "send/recv") for work in works]
        for work in works:
            _Work(work, axis, "send/recv").wait()
        return None
    return [_Work(work, axis, t.kind, t.peer) for t, work in zip(transfers, works)]


def barrier(axis: AxisGroup) -> None:
    """Wait until every rank of ``axis`` has called it (not counted: it carries no data)."""
    if axis.size > 1:
        _call(axis, "barrier", dist.barrier, group=axis.group)


def all_gather_object(obj, axis: AxisGroup) -> list:
    """Every rank's ``obj`` on ``axis``, in rank order (pickled; small objects only)."""
    if axis.size == 1:
        return [obj]
    out = [None] * axis.size
    _call(axis, "all_gather_object", dist.all_gather_object, out, obj, group=axis.group)
    return out


def broadcast_object(obj, axis: AxisGroup, *, src: int = 0):
    """``obj`` of the rank with index ``src`` in ``axis``, on every rank of it (pickled; small)."""
    if axis.size == 1:
        return obj
    box = [obj]
    _call(axis, "broadcast_object", dist.broadcast_object_list, box, group_src=src, group=axis.group)
    return box[0]
