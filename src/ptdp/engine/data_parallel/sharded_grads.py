"""The gradient side of ``--data-parallel-sharding-strategy optim_grads`` and
``optim_grads_params`` (ZeRO-2 and 3; Rajbhandari et al., arXiv:1910.02054): the memory of the
full-size buckets of a :class:`~ptdp.engine.data_parallel.buffer.GradBuffer` built with
``shard_grads=True``, and their reduce-scatters into the rank's shard.

Every microbatch's backward reduce-scatters each bucket it touched and adds the result into
:attr:`GradBuffer.shard_grads`. A bucket's memory exists from when backward reaches the module
holding its first parameter (:meth:`GradBuffer.watch`) until its reduce-scatter finishes; at most
two are in flight. The tied embedding keeps its own bucket, summed over the embedding group as a
shard (:func:`~ptdp.engine.data_parallel.grads.finalize_grads`). Chunk by chunk
(:func:`ptdp.layout.buckets.chunk_by_chunk`, set by :meth:`GradBuffer.begin_backwards`), a chunk's
buckets accumulate its microbatches of one round of the interleaved schedule under
:meth:`GradBuffer.no_sync` and are reduce-scattered once per round (:meth:`GradBuffer.chunk_done`;
Dubey et al. 2024, arXiv:2407.21783, §3.3.2), the first round's straight into the shard, later
rounds' added to it.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.engine.comm import AxisGroup
from ptdp.engine.data_parallel.bucket_layout import Bucket
from ptdp.engine.data_parallel.compression import start_reduction
from ptdp.layout.buckets import chunk_by_chunk


class ShardedGradients:
    """What :class:`~ptdp.engine.data_parallel.buffer.GradBuffer` does with ``shard_grads``: its
    buckets' memory during backward (:meth:`watch`), their reduce-scatters (at most two in flight)
    and, chunk by chunk, when they start (:meth:`begin_backwards`, :meth:`chunk_done`). The
    attributes below are the buffer's (set in its constructor)."""

    buckets: list[Bucket]
    params: list[nn.Parameter]
    dp: AxisGroup
    codec: str
    exact: bool
    grad_scale: float | torch.Tensor
    prescaled: bool
    average_over: int
    grads_sharded: bool
    by_chunk: bool
    live_bytes: int
    peak_live_bytes: int
    _strategy: str
    _bucket_of: dict[int, Bucket]
    _launched: list[Bucket]
    _reduced: set[int]

    def _launch(self, bucket: Bucket) -> None:
        raise NotImplementedError  # GradBuffer's

    def begin_backwards(self, virtual_stages: int, num_microbatches: int, pp: int, split: bool = False) -> None:
        """Before a step's backwards: whether they reduce chunk by chunk (:attr:`by_chunk`, with
        ``shard_grads`` over d > 1 ranks: :func:`~ptdp.layout.buckets.chunk_by_chunk` of the
        schedule's ``virtual_stages`` chunks, ``num_microbatches`` and ``pp``; with ``split``, a
        zero-bubble schedule's weight gradients coming after their B, always, once per step: the
        buckets stay allocated until the W completing the chunk's gradients)."""
        self.by_chunk = self.grads_sharded and (
            split or chunk_by_chunk(self._strategy, self.dp.size, virtual_stages, num_microbatches, pp)
        )
        self._reduced = set()

    def chunk_done(self, chunk: int) -> None:
        """After the last backward of ``chunk`` in a round: with :attr:`by_chunk`, start the
        reduce-scatter of each of its buckets holding gradients and not started (in bucket order,
        the same on every rank; at most two in flight); otherwise nothing."""
        if not self.by_chunk:
            return
        for bucket in self.buckets:
            if bucket.chunk == chunk and bucket.finish is None and bucket.own_data().untyped_storage().nbytes():
                self._launch_in_turn(bucket)

    def _launch_in_turn(self, bucket: Bucket) -> None:
        """``shard_grads``: start ``bucket``'s reduction, first landing the oldest of two in flight."""
        while len(self._launched) >= 2:
            self._land(self._launched.pop(0))
        self._launch(bucket)

    def watch(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """``shard_grads`` only: for each (module, parameters) pair, allocate the buckets holding
        those parameters when a backward reaches the module's output (a tensor hook on each
        output that needs a gradient, set by a forward hook): before any of their gradients is
        written. Every parameter must be in a pair whose module's output its gradient flows
        through (ptdp's stages: each transformer layer with its parameters, each chunk with the
        rest)."""
        covered = {id(p) for _, params in units for p in params}
        missing = [tuple(p.shape) for p in self.params if id(p) not in covered]
        if missing:
            raise ValueError(f"shard_grads: parameters of shapes {missing} belong to no watched module")
        for module, params in units:
            buckets = list(
                {id(b): b for b in (self._bucket_of[id(p)] for p in params if id(p) in self._bucket_of)}.values()
            )
            if buckets:
                module.register_forward_hook(lambda _m, _args, out, buckets=buckets: self._watch_output(out, buckets))

    def _watch_output(self, out, buckets: list[Bucket]) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: self._allocate(buckets))

    def _allocate(self, buckets: list[Bucket]) -> None:
        """Give ``buckets`` their memory back, zeroed (no-op for those that have it); chunk by chunk,
        first land a bucket's reduction of the previous round still in flight."""
        for bucket in buckets:
            pending = [i for i, b in enumerate(self._launched) if b is bucket]
            if pending:
                self._land(self._launched.pop(pending[0]))
            data = bucket.own_data()
            storage = data.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(bucket.numel * data.element_size())
                data.zero_()
                self.live_bytes += storage.nbytes()
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _release(self, bucket: Bucket) -> None:
        """Free ``bucket``'s gradient memory; the parameters' views stay valid objects (FSDP's
        ``resize_(0)`` idiom) and get memory again in :meth:`_allocate`."""
        storage = bucket.own_data().untyped_storage()
        self.live_bytes -= storage.nbytes()
        storage.resize_(0)

    def flush(self) -> None:
        """``shard_grads``, after a backward: start the reduction of every bucket that backward
        touched and has not started, wait for all started ones (each adds its reduced shard into
        :attr:`shard_grads`), and release the flat buffer."""
        for bucket in self.buckets:
            if bucket.ready and bucket.finish is None:
                self._launch(bucket)
        while self._launched:
            self._land(self._launched.pop(0))
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.finish = None
            self._release(bucket)

    def _land(self, bucket: Bucket) -> None:
        """``shard_grads``: wait for ``bucket``'s reduce-scatter (adding it into the shard) and
        release its gradient memory; chunk by chunk, ready for the next round's reduction."""
        bucket.wait()
        self._release(bucket)
        if self.by_chunk:
            bucket.finish = None
            bucket.ready.clear()

    def _launch_into_shard(self, bucket: Bucket, grad: torch.Tensor, shard: torch.Tensor) -> None:
        """``shard_grads``: reduce-scatter this backward's ``grad`` of ``bucket`` into a scratch
        shard (1/d of the bucket) whose finish adds it into the accumulated ``shard``; with
        :attr:`by_chunk` (reduced once per round) the first round's straight into ``shard`` (zeroed)."""
        if self.by_chunk and bucket.index not in self._reduced:
            self._reduced.add(bucket.index)
            bucket.finish = start_reduction(
                "none" if self.exact else self.codec,
                grad,
                self.dp,
                shard=shard,
                grad_scale=self.grad_scale,
                average=not self.prescaled,
                divisor=self.average_over,
            )
        elif self.dp.size == 1:
            shard.add_(grad)
            bucket.finish = _done
        else:
            scratch = torch.empty_like(shard)
            wait = start_reduction(
                "none" if self.exact else self.codec,
                grad,
                self.dp,
                shard=scratch,
                grad_scale=self.grad_scale,
                average=not self.prescaled,
                divisor=self.average_over,
            )

            def finish() -> None:
                wait()
                shard.add_(scratch)

            bucket.finish = finish
        self._launched.append(bucket)


def _done() -> None:
    """A reduction with nothing to wait for."""
