"""Parameters sharded over the data-parallel ranks (``--data-parallel-sharding-strategy
optim_grads_params``, ZeRO-3; Rajbhandari et al., "ZeRO", arXiv:1910.02054, §5.3): a rank keeps
only its shard of every parameter and gathers a unit's full parameters just while it computes.

Units (:func:`sharding_units`) per chunk: its embeddings, each layer, its head. No bucket spans two
units, so rank r's shard of a unit is the r-th ``1/d`` of each of its buckets (d = dp x cp), the
gradient shard's layout. Each bucket's full tensor has memory only while gathered
(``untyped_storage().resize_``, FSDP's idiom); :attr:`ParamUnits.shard` is what the optimizer updates:
for 16-bit parameters a float32 shard, the optimizer's main parameters themselves (as FSDP2 keeps
float32 shards under a bf16 ``MixedPrecisionPolicy``, torchtitan's default), cast to 16 bits for
each all-gather (a transient of the unit's shard).
Forward: a unit's pre-hook waits for its all-gather and prefetches the next; its forward hook frees
it (``reshard_after_forward``). Backward: a hook on its output gathers it again (prefetching the
previous); it is freed once all its gradients are accumulated. The embeddings are not gathered for
backward (:attr:`UnitUse.read_in_backward`). Communication (dp axis, tag ``params``): one
all-gather of ``numel / d`` per bucket each time a unit is gathered (``2 m`` per step with
resharding); none after the optimizer step (:meth:`invalidate`). No host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.engine.comm import Handle, all_gather_async
from ptdp.engine.data_parallel.bucket_layout import Bucket, Segment
from ptdp.engine.data_parallel.buffer import GradBuffer

if TYPE_CHECKING:
    from ptdp.engine.model.gpt import GPTModel


@dataclass(frozen=True, eq=False)
class UnitUse:
    """Where a unit's parameters are used in a model chunk's forward: from ``start``'s forward
    pre-hook to ``end``'s forward hook (``end`` None: until the next unit starts, whose input is
    then the unit's output)."""

    chunk: int
    params: list[nn.Parameter]
    start: nn.Module
    end: nn.Module | None
    read_in_backward: bool = True
    """Whether the unit's backward reads its parameters, so that backward gathers it again
    (False: tables only looked up, whose gradients need the ids alone)."""


def param_gather_units(chunks: Sequence[GPTModel]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Who waits for which parameters with ``overlap_param_gather``: each transformer layer for
    its own; each chunk, when its forward starts, for the rest (embeddings, final norm, output
    layer: the output weight is read directly, not through a module call)."""
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []
    for chunk in chunks:
        layers = list(chunk.layers.values())
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        units.append((chunk, [p for p in chunk.parameters() if id(p) not in in_layers]))
        units.extend((layer, list(layer.parameters())) for layer in layers)
    return units


def sharding_units(chunks: Sequence[GPTModel]) -> list[UnitUse]:
    """The units of ``chunks`` (``GPTModel`` stages), per chunk in forward order: the embeddings
    (until the first layer starts; not read in backward), each transformer layer, and the head
    (final norm, output layer; to the end of the loss). With one tied word embedding in the chunk
    (pp = 1), one unit of all but the layers, for the whole forward, read in backward."""
    units: list[UnitUse] = []
    for c, chunk in enumerate(chunks):
        layers = list(chunk.layers.values())
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        rest = [p for p in chunk.parameters() if id(p) not in in_layers]
        layer_units = [UnitUse(c, list(layer.parameters()), layer, layer) for layer in layers]
        lookup = getattr(chunk, "word_embeddings", None)
        projects = lookup is not None and chunk.post_process and not hasattr(chunk, "output_layer")
        if projects and chunk.pre_process:  # one table read first and last
            units += [UnitUse(c, rest, chunk, chunk), *layer_units]
            continue
        head_modules = [getattr(chunk, n) for n in ("final_norm", "output_layer") if hasattr(chunk, n)]
        head = [p for m in head_modules for p in m.parameters()]
        if projects and lookup is not None:  # the last stage's copy of the tied table
            head.append(lookup.weight)
        in_head = {id(p) for p in head}
        embed = [p for p in rest if id(p) not in in_head]
        units += [UnitUse(c, embed, chunk, None, read_in_backward=False)] if embed else []
        units += layer_units
        units += [UnitUse(c, head, chunk.final_norm, chunk)] if head else []
    return units


def gradient_units(chunks: Sequence[GPTModel]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Which module's output, reached by backward, allocates which parameters' gradient buckets
    with ``optim_grads`` (:meth:`GradBuffer.watch`): each transformer layer its own; the word
    embedding its weight where only the lookup reads it (a first stage without a tied output
    layer), and the embedding dropout, whose input is the sum of the lookups, the learned position
    table, so that these buckets exist only at the end of backward; each chunk the rest when its
    backward starts (the output layer, read directly, comes first)."""
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []
    for chunk in chunks:
        layers = list(chunk.layers.values())
        taken = {id(p) for layer in layers for p in layer.parameters()}
        positions = getattr(chunk, "position_embeddings", None)
        if positions is not None:  # its gradient flows through the embedding dropout only
            units.append((chunk.embedding_dropout, [positions]))
            taken.add(id(positions))
        lookup = getattr(chunk, "word_embeddings", None)
        if lookup is not None and chunk.pre_process and (hasattr(chunk, "output_layer") or not chunk.post_process):
            units.append((lookup, [lookup.weight]))
            taken.add(id(lookup.weight))
        units.append((chunk, [p for p in chunk.parameters() if id(p) not in taken]))
        units.extend((layer, list(layer.parameters())) for layer in layers)
    return units


def unit_index(specs: list[UnitUse]) -> dict[int, int]:
    """Parameter id -> index of its unit in ``specs`` (for the bucket plan)."""
    return {id(p): i for i, spec in enumerate(specs) for p in spec.params}


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class Unit:
    """One unit: its buckets, their full parameter tensors (memory only while gathered) and their
    shards in :attr:`ParamUnits.shard`."""

    index: int
    chunk: int
    params: list[nn.Parameter]
    buckets: list[Bucket]
    fulls: list[torch.Tensor]
    shards: list[torch.Tensor]
    read_in_backward: bool = True
    """Gathered again when backward reaches it (:attr:`UnitUse.read_in_backward`)."""
    gathered: bool = False
    """Memory allocated and the all-gathers issued (maybe not finished: ``pending``)."""
    pending: list[Handle] = field(default_factory=list)
    casts: list[torch.Tensor] = field(default_factory=list)
    """16-bit copies of float32 shards sent by the all-gathers in flight."""
    ready: set[int] = field(default_factory=set)
    """Parameters whose gradient this backward has accumulated."""

    @property
    def nbytes(self) -> int:
        return sum(full.numel() * full.element_size() for full in self.fulls)


class ParamUnits:
    """The parameters of a sharded ``grads`` (built with ``shard=True`` and ``unit_of`` from
    :func:`unit_index` of ``specs``) kept as this rank's shard and gathered unit by unit (module
    docstring). Moves the parameters out of ``grads.param_data`` (then None) into per-bucket full
    tensors, keeps this rank's shard of them in :attr:`shard`, and installs the hooks on the
    modules of ``specs`` and on ``chunks`` (the model chunks, whose microbatches in flight decide
    when kept units are freed)."""

    def __init__(
        self,
        grads: GradBuffer,
        specs: list[UnitUse],
        chunks: Sequence[nn.Module],
        *,
        reshard_after_forward: bool = True,
    ) -> None:
        param_data = grads.param_data
        if param_data is None:
            raise ValueError("ParamUnits needs a GradBuffer built with shard=True")
        self.grads, self.dp, self.reshard = grads, grads.dp, reshard_after_forward
        d, rank = self.dp.size, self.dp.rank
        self.param_dtype = param_data.dtype
        """The model's (gathered) parameter dtype; :attr:`shard` is float32 when it has 16 bits."""
        low_precision = param_data.dtype in (torch.bfloat16, torch.float16)
        shard_dtype = torch.float32 if low_precision else param_data.dtype
        self.shard = torch.empty(param_data.numel() // d, dtype=shard_dtype, device=param_data.device)
        of = unit_index(specs)
        parts: dict[int, list[tuple[Bucket, torch.Tensor, torch.Tensor]]] = {}
        for bucket in grads.buckets:
            owners = {of[id(p)] for p in bucket.params}
            if len(owners) != 1:
                raise ValueError(
                    f"bucket {bucket.index} holds parameters of units {sorted(owners)} (plan with unit_of)"
                )
            full = param_data[bucket.start : bucket.start + bucket.numel].clone()
            per = bucket.numel // d
            shard = self.shard[bucket.start // d : bucket.start // d + per]
            shard.copy_(full[rank * per : (rank + 1) * per])
            offset = 0
            for p in bucket.params:
                p.data = full[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            full.untyped_storage().resize_(0)
            parts.setdefault(owners.pop(), []).append((bucket, full, shard))
        grads.param_data = None  # the rank keeps the shard only
        self.units = [
            Unit(
                i,
                spec.chunk,
                spec.params,
                [b for b, _, _ in parts.get(i, [])],
                [full for _, full, _ in parts.get(i, [])],
                [shard for _, _, shard in parts.get(i, [])],
                read_in_backward=spec.read_in_backward,
            )
            for i, spec in enumerate(specs)
        ]
        self.inflight = [0] * len(chunks)
        """Microbatches of each chunk whose forward ran and whose backward has not started."""
        self.live_bytes = 0
        self.peak_live_bytes = 0
        """The most gathered parameter bytes at once in forward and backward (host-side
        bookkeeping; :meth:`gather_all` not counted): the transient."""
        self._queued_task: int | None = None
        self._install(specs, chunks)

    def _install(self, specs: list[UnitUse], chunks: Sequence[nn.Module]) -> None:
        order: dict[int, list[Unit]] = {}
        for unit in self.units:
            order.setdefault(unit.chunk, []).append(unit)
        self.next: dict[int, Unit | None] = {}  # forward order: prefetched when a unit starts
        self.prev: dict[int, Unit | None] = {}  # backward order: prefetched when backward reaches a unit
        self.ends_here: dict[int, Unit] = {}  # unit -> the unit (spec.end None) whose use its start ends
        for seq in order.values():
            for i, unit in enumerate(seq):
                self.next[unit.index] = seq[i + 1] if i + 1 < len(seq) else None
                if i > 0 and specs[seq[i - 1].index].end is None:
                    self.ends_here[unit.index] = seq[i - 1]
            # backward: the unit ending with the chunk first (gathered when the chunk's backward
            # starts; one that also started with the chunk is held to its end), then the others
            # back to front, those backward does not read left out
            chunk = chunks[seq[0].chunk]
            backward = [u for u in seq if specs[u.index].end is chunk]
            backward += [u for u in reversed(seq) if specs[u.index].end is not chunk]
            backward = [u for u in backward if u.read_in_backward]
            for i, unit in enumerate(backward):
                self.prev[unit.index] = backward[i + 1] if i + 1 < len(backward) else None
        for c, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(lambda _m, _a, c=c: self._chunk_forward(c))
            chunk.register_forward_hook(lambda _m, _a, out, c=c: self._chunk_output(c, out))
        for unit, spec in zip(self.units, specs):
            spec.start.register_forward_pre_hook(lambda _m, args, u=unit: self._before_forward(u, args))
            if spec.end is not None:
                spec.end.register_forward_hook(lambda _m, _a, out, u=unit: self._after_forward(u, out))
            for p in spec.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u, p))

    def shard_view(self, seg: Segment) -> torch.Tensor:
        """This rank's values of segment ``seg`` (``[hi - lo]``, a view of :attr:`shard`)."""
        return self.shard[seg.shard_offset : seg.shard_offset + seg.hi - seg.lo]

    @property
    def held_bytes(self) -> int:
        """Parameter bytes this rank keeps between uses: its shard."""
        return self.shard.numel() * self.shard.element_size()

    # -- gathering and freeing -------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        """Allocate ``unit``'s full tensors and issue their all-gathers (no-op when gathered)."""
        if unit.gathered:
            return
        for full, shard in zip(unit.fulls, unit.shards):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if shard.dtype != full.dtype:
                shard = shard.to(full.dtype)
                unit.casts.append(shard)
            unit.pending.append(all_gather_async(full, shard, self.dp, tag="params"))
        unit.gathered = True
        self.live_bytes += unit.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _wait(self, unit: Unit) -> None:
        """Gather ``unit`` if needed and finish its all-gathers."""
        self._gather(unit)
        while unit.pending:
            unit.pending.pop(0).wait()
        unit.casts.clear()

    def _free(self, unit: Unit) -> None:
        """Release ``unit``'s full tensors (after finishing a gather still in flight)."""
        if not unit.gathered:
            return
        while unit.pending:
            unit.pending.pop(0).wait()
        unit.casts.clear()
        for full in unit.fulls:
            full.untyped_storage().resize_(0)
        unit.gathered = False
        self.live_bytes -= unit.nbytes

    def gather_all(self) -> None:
        """Gather every unit and finish (to read the parameters outside a forward, e.g.
        checkpoints); the next forward of each unit frees it again, as does :meth:`invalidate`. Not
        counted in :attr:`peak_live_bytes` (the training transient)."""
        peak = self.peak_live_bytes
        for unit in self.units:
            self._gather(unit)
        for unit in self.units:
            self._wait(unit)
        self.peak_live_bytes = peak

    def invalidate(self) -> None:
        """Free every gathered unit: after the optimizer updated :attr:`shard` their copies are stale."""
        for unit in self.units:
            self._free(unit)
            unit.ready.clear()

    def take_shards(self) -> None:
        """After the full parameters were written in place (a checkpoint loaded into them, every
        unit gathered): keep this rank's part of them in :attr:`shard`."""
        rank = self.dp.rank
        for unit in self.units:
            self._wait(unit)
            for full, shard in zip(unit.fulls, unit.shards):
                shard.copy_(full[rank * shard.numel() : (rank + 1) * shard.numel()])

    # -- hooks -------------------------------------------------------------------------------

    def _keep(self, unit: Unit) -> bool:
        return not self.reshard and self.inflight[unit.chunk] > 0

    def _chunk_forward(self, chunk: int) -> None:
        if torch.is_grad_enabled() and not in_backward():
            self.inflight[chunk] += 1

    def _chunk_output(self, chunk: int, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad and not in_backward():
            out.register_hook(lambda _grad: self._chunk_backward(chunk))

    def _chunk_backward(self, chunk: int) -> None:
        self.inflight[chunk] -= 1
        task = torch._C._current_graph_task_id()
        if task != self._queued_task:  # once per backward: free what its hooks did not
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued_task = None
        for unit in self.units:
            unit.ready.clear()
            if not self._keep(unit):
                self._free(unit)

    def _before_forward(self, unit: Unit, args: tuple) -> None:
        ended = self.ends_here.get(unit.index)
        if ended is not None and args and isinstance(args[0], torch.Tensor):  # its output is this input
            self._after_forward(ended, args[0])
        self._wait(unit)
        following = self.next[unit.index]
        if following is not None and not in_backward():  # a recompute gathers what it runs
            self._gather(following)

    def _after_forward(self, unit: Unit, out) -> None:
        if in_backward():  # a recompute: the unit's backward comes next
            return
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            if unit.read_in_backward:
                out.register_hook(lambda _grad: self._before_backward(unit))
            if self.reshard:
                self._free(unit)
        else:
            self._free(unit)

    def _before_backward(self, unit: Unit) -> None:
        self._wait(unit)
        previous = self.prev[unit.index]
        if previous is not None:
            self._gather(previous)

    def _grad_ready(self, unit: Unit, param: torch.Tensor) -> None:
        unit.ready.add(id(param))
        if len(unit.ready) == len(unit.params):
            unit.ready.clear()
            if not self._keep(unit):
                self._free(unit)
