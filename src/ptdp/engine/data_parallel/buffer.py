"""Gradient buckets of one model-parallel shard, reduced over the data-parallel group.

The group is the dp x cp ranks sharing this rank's tp and pp ranks (``ParallelGroups.dp_cp``):
the reduction sums over cp (partial gradients of the same microbatches) and averages over dp.
Gradients live in one flat buffer cut into buckets (at most ``bucket_size`` elements, never
spanning two chunks, filled in reverse parameter order as in Megatron-LM and PyTorch DDP). A
bucket's reduction starts when its last gradient is ready in the synchronising microbatch's
backward (``overlap``; others run under :meth:`GradBuffer.no_sync`), else in :meth:`GradBuffer.finish`.

``shard=True`` (ZeRO-1; Rajbhandari et al., arXiv:1910.02054): buckets padded to a multiple of the
group size, reduce-scattered into :attr:`GradBuffer.shard_grads`; ``shard_grads=True`` (ZeRO-2):
:mod:`ptdp.engine.data_parallel.sharded_grads`. 16-bit parameters get a ``main_grad`` (float32, or
bfloat16 with ``--grad-reduce-in-bf16``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ptdp.engine.comm import AxisGroup
from ptdp.engine.data_parallel.bucket_layout import Bucket, Segment, plan_buckets
from ptdp.engine.data_parallel.compression import block_sizes, start_reduction
from ptdp.engine.data_parallel.sharded_grads import ShardedGradients

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; Megatron-LM's default


class GradBuffer(ShardedGradients):
    """Flat gradient buckets for the parameters of each model chunk (``chunk_params[c]``).

    ``dp``: the group reduced (and sharded) over, the dp x cp ranks (``ParallelGroups.dp_cp``);
    ``grad_dtype``: buffer dtype; ``main_grad``: gradients go to ``param.main_grad`` views
    (default: when ``grad_dtype`` differs from the parameters'); ``bucket_size``: most elements per bucket; ``codec``: ``none``,
    ``fp16``, ``bf16`` or ``1bit`` (:mod:`ptdp.engine.data_parallel.compression`); ``deferred``:
    parameters whose bucket starts late (the tied embedding); ``prescaled``: gradients arrive
    divided by dp, so reductions sum; ``average_over``: the divisor otherwise (default
    ``dp.size``); ``shard``/``shard_grads``/``unit_of``: ZeRO-1/2/3 (module docstring).
    """

    def __init__(
        self,
        chunk_params: list[list[nn.Parameter]],
        *,
        dp: AxisGroup,
        grad_dtype: torch.dtype | None = None,
        main_grad: bool | None = None,
        bucket_size: int | None = None,
        overlap: bool = False,
        codec: str = "none",
        shard: bool = False,
        deferred: tuple[nn.Parameter, ...] = (),
        prescaled: bool = False,
        average_over: int | None = None,
        shard_grads: bool = False,
        unit_of: dict[int, int] | None = None,
    ) -> None:
        params = [p for ps in chunk_params for p in ps]
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {sorted(map(str, dtypes))}")
        if shard_grads and (not shard or codec == "1bit"):
            raise ValueError(
                f"shard_grads needs shard=True and a codec other than 1bit (got shard={shard}, codec={codec!r})"
            )
        self.params, self.dp, self.codec, self.sharded, self.prescaled = params, dp, codec, shard, prescaled
        self.grads_sharded = shard_grads
        self.by_chunk = False
        """Reduce each chunk's gradient once per round (module docstring); set by :meth:`begin_backwards`."""
        self._strategy = "optim_grads_params" if unit_of is not None else "optim_grads"  # with shard_grads
        self.average_over = dp.size if average_over is None else average_over
        self.exact = False
        """Reduce in the buffer's dtype whatever ``codec`` is (compression warmup); set per step."""
        self.step_scale: torch.Tensor | None = None
        """Clip coefficient for the float32 copy of a bf16 buffer's gradients at the optimizer step
        (``--grad-reduce-in-bf16``); reset by :meth:`zero`."""
        self.grad_scale: float | torch.Tensor = 1.0
        """How much the gradients in the buffer are scaled (1/dp when ``prescaled``; with float16
        the loss scale, a 0-dim float32 tensor on the device); set per step."""
        self.uses_main_grad = (
            grad_dtype is not None and grad_dtype != params[0].dtype if main_grad is None else main_grad
        )
        self.buckets = plan_buckets(
            chunk_params,
            bucket_size or DEFAULT_BUCKET_SIZE,
            overlap,
            {id(p) for p in deferred},
            dp.size if shard else 1,
            unit_of,
        )
        total = sum(b.numel for b in self.buckets)
        device = params[0].device
        self.data = torch.zeros(total, dtype=grad_dtype or params[0].dtype, device=device)
        self.residual = torch.zeros_like(self.data) if codec == "1bit" else None
        self.shard_grads = torch.zeros(total // dp.size, dtype=self.data.dtype, device=device) if shard else None
        self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device) if shard else None
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, Bucket] = {}
        self._syncing = True
        self._launched: list[Bucket] = []
        self._reduced: set[int] = set()  # chunk by chunk: buckets reduced once this step
        self.live_bytes = 0
        """``shard_grads``: bytes of bucket gradient memory allocated now (host-side bookkeeping)."""
        self.peak_live_bytes = 0
        """``shard_grads``: the most bucket gradient bytes ever allocated at once (the transient)."""
        if shard_grads:  # a tensor per bucket, released until a backward needs it
            for bucket in self.buckets:
                bucket.data = torch.zeros(bucket.numel, dtype=self.data.dtype, device=device)
            self.data.untyped_storage().resize_(0)  # kept for its size and dtype only
        self._place_params()
        self.segments = self._shard_segments() if shard else []
        if shard_grads:
            for bucket in self.buckets:
                bucket.own_data().untyped_storage().resize_(0)
        if codec == "1bit":
            for bucket in self.buckets:
                lengths = [p.numel() for p in bucket.params]
                padding = bucket.numel - sum(lengths)  # dp padding: a segment of its own
                bucket.blocks = block_sizes(lengths + ([padding] if padding else []), device)

    def _place_params(self) -> None:
        for bucket in self.buckets:
            offset = bucket.start
            flat, base = (self.data, 0) if bucket.data is None else (bucket.data, bucket.start)
            for p in bucket.params:
                view = flat[offset - base : offset - base + p.numel()].view_as(p)
                self._views[id(p)] = view
                self._bucket_of[id(p)] = bucket
                if self.param_data is not None:
                    pview = self.param_data[offset : offset + p.numel()].view_as(p)
                    pview.copy_(p.detach())
                    p.data = pview
                if self.uses_main_grad:
                    p.main_grad = view  # type: ignore[attr-defined]  # a dynamic attribute, as in Megatron
                else:
                    p.grad = view
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                offset += p.numel()

    def _shard_segments(self) -> list[Segment]:
        out, rank, dp = [], self.dp.rank, self.dp.size
        for bucket in self.buckets:
            per = bucket.numel // dp
            lo_shard, hi_shard = bucket.start + rank * per, bucket.start + (rank + 1) * per
            offset = bucket.start
            for p in bucket.params:
                lo, hi = max(offset, lo_shard), min(offset + p.numel(), hi_shard)
                if lo < hi:
                    out.append(Segment(p, lo - offset, hi - offset, bucket.start // dp + (lo - lo_shard)))
                offset += p.numel()
        return out

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The accumulated gradient of ``param`` (a view into the buffer; not yet reduced)."""
        return self._views[id(param)]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without starting any data-parallel reduction (PyTorch DDP's name).

        With ``shard_grads`` the reductions are not deferred (except chunk by chunk,
        :attr:`by_chunk`): the backward run inside reduces as any other, and leaving the context
        finishes its reductions into the shard and releases the flat buffer (:meth:`flush`)."""
        if self.grads_sharded and not self.by_chunk:
            yield
            self.flush()
            return
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    @property
    def held_bytes(self) -> int:
        """Gradient bytes this rank keeps between microbatches: the flat buffer, or with
        ``shard_grads`` only :attr:`shard_grads` (the buffer exists during a backward only)."""
        kept = self._shard() if self.grads_sharded else self.data
        return kept.numel() * kept.element_size()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.grads_sharded and self._bucket_of[id(param)].own_data().untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"shard_grads: a gradient (shape {tuple(param.shape)}) arrived in bucket "
                f"{self._bucket_of[id(param)].index} before its memory was allocated (GradBuffer.watch)"
            )
        if self.uses_main_grad and param.grad is not None:  # None: its layer added it to main_grad
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]  # set in _place_params (wgrad.py)
            param.grad = None
        self.param_ready(param)

    def chunk_params(self, chunk: int) -> list[nn.Parameter]:
        """The parameters of model chunk ``chunk`` in this buffer, bucket by bucket."""
        return [p for bucket in self.buckets if bucket.chunk == chunk for p in bucket.params]

    def param_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete for the step (outside :meth:`no_sync`): its bucket's
        reduction starts once all its parameters are (with overlap). Called by each gradient's
        post-accumulate hook, and for a weight gradient computed outside autograd (a zero-bubble
        schedule's W) by its caller."""
        if self.grads_sharded:  # every backward reduces; ready also marks the bucket touched
            if not self._syncing:  # by_chunk, under no_sync: accumulating the chunk's microbatches
                return
            bucket = self._bucket_of[id(param)]
            bucket.ready.add(id(param))
            if bucket.overlap and bucket.finish is None and len(bucket.ready) == len(bucket.params):
                self._launch_in_turn(bucket)  # at most two buckets in flight
            return
        if not self._syncing or self.dp.size == 1:  # accumulating (no_sync), or nothing to reduce
            return
        bucket = self._bucket_of[id(param)]
        if not bucket.overlap:
            return
        if bucket.finish is not None:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index} after its reduction started (shape "
                f"{tuple(param.shape)}); with overlap, run every backward but the step's last under no_sync()"
            )
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        grad = self.data[bucket.start : bucket.start + bucket.numel] if bucket.data is None else bucket.data
        shard = None
        if self.shard_grads is not None:
            per = bucket.numel // self.dp.size
            shard = self.shard_grads[bucket.start // self.dp.size : bucket.start // self.dp.size + per]
        if self.grads_sharded:
            return self._launch_into_shard(bucket, grad, self._shard_of(bucket))
        residual = self.residual[bucket.start : bucket.start + bucket.numel] if self.residual is not None else None
        codec = "none" if self.exact else self.codec
        bucket.finish = start_reduction(
            codec,
            grad,
            self.dp,
            shard=shard,
            residual=residual,
            grad_scale=self.grad_scale,
            blocks=bucket.blocks,
            average=not self.prescaled,
            divisor=self.average_over,
        )
        self._launched.append(bucket)

    def finish(self) -> None:
        """Start every bucket not started yet (in bucket order), then wait for all: afterwards the
        buffer (or, sharded, :attr:`shard_grads`) holds the gradients summed over cp and averaged
        over dp. With ``shard_grads``: :meth:`flush` (buckets the last backward did not touch
        hold nothing new)."""
        if self.grads_sharded:
            self.flush()
            return
        if self.dp.size == 1:  # nothing to average; a sharded buffer's one shard is everything
            if self.shard_grads is not None:
                self.shard_grads.copy_(self.data)
            return
        for bucket in self.buckets:
            if bucket.finish is None:
                self._launch(bucket)
        for bucket in self._launched:
            bucket.wait()
        self._launched = []

    def bucket_shard(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's share of the reduction of ``param``'s bucket in :attr:`shard_grads`
        (``[bucket numel / d]``, padding included); sharded buffers only."""
        return self._shard_of(self._bucket_of[id(param)])

    def _shard(self) -> torch.Tensor:
        """:attr:`shard_grads` of a sharded buffer (ValueError for another)."""
        if self.shard_grads is None:
            raise ValueError("only a buffer built with shard=True has shard_grads")
        return self.shard_grads

    def _shard_of(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s ``[numel / d]`` share in :attr:`shard_grads` (d = dp size, padding included)."""
        d = self.dp.size
        return self._shard()[bucket.start // d : (bucket.start + bucket.numel) // d]

    @property
    def reduced(self) -> torch.Tensor:
        """Where the averaged gradients are after :meth:`finish`: the buffer, or this rank's shard."""
        return self.shard_grads if self.shard_grads is not None else self.data

    def zero(self) -> None:
        """Zero the gradients and forget started reductions, before the next step."""
        self.step_scale = None
        if self.grads_sharded:  # the flat buffer was released by the last flush
            self._shard().zero_()
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.finish = None
            self._launched = []
            for bucket in self.buckets:
                self._release(bucket)
            return
        if not self.uses_main_grad:
            storage = self.data.untyped_storage().data_ptr()
            for p in self.params:
                if p.grad is None or p.grad.untyped_storage().data_ptr() != storage:
                    raise RuntimeError(
                        "a parameter's .grad no longer views the gradient buffer (was zero_grad called?)"
                    )
        self.data.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.finish = None
