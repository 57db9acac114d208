"""The distributed optimizer (ZeRO stage 1; Rajbhandari et al., "ZeRO", arXiv:1910.02054;
Megatron-LM's ``DistributedOptimizer``): each data-parallel rank keeps Adam's moments, and for
16-bit models the float32 main parameters, only for its 1/dp shard of every gradient bucket,
updates that shard from the reduce-scattered gradients, and all-gathers the updated parameters.
With context parallelism the shards are over all d = dp x cp ranks holding the same parameters
(the gradient buffer's group, ``ParallelGroups.dp_cp``); below, dp stands for that d.

Memory per rank: optimizer state 8 / dp bytes per parameter (12 / dp with float32 main
parameters) plus bucket padding. Communication per step, on dp: the gradients' reduce-scatter
(:class:`~ptdp.engine.data_parallel.buffer.GradBuffer`) and one all-gather of the parameters per
bucket, in the next forward's order with ``overlap_param_gather`` (Megatron-LM's
``--overlap-param-gather``). With ``optim_grads_params``
(:class:`~ptdp.engine.data_parallel.units.ParamUnits`) the shard is the only copy: no all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.engine.comm import Handle, all_gather_async
from ptdp.engine.data_parallel.bucket_layout import Segment
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.optim.adamw import adamw, float32_grads, step_unless

if TYPE_CHECKING:
    from ptdp.engine.data_parallel.units import ParamUnits


class ShardedAdamW:
    """AdamW over this rank's shard of ``grads`` (a sharded :class:`GradBuffer`).

    Weight decay on parameters with >= 2 dims; 16-bit parameters through a float32 copy of the
    shard. ``overlap_with``: (module, parameters) pairs whose forward waits for those parameters'
    all-gathers (every parameter in some pair); otherwise read parameters after
    :meth:`wait_for_params`. ``units`` (``optim_grads_params``): the step updates
    :attr:`ParamUnits.shard`; :meth:`wait_for_params` gathers every unit.
    """

    def __init__(
        self,
        grads: GradBuffer,
        *,
        weight_decay: float,
        overlap_with: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
        units: ParamUnits | None = None,
        **adam_kwargs,
    ) -> None:
        shard_grads = grads.shard_grads
        param_data = grads.param_data if units is None else units.shard
        if not grads.sharded or param_data is None or shard_grads is None:
            raise ValueError("ShardedAdamW needs a GradBuffer built with shard=True")
        if units is not None and overlap_with is not None:
            raise ValueError("sharded parameters are gathered by their units, not after the step (overlap_with)")
        self.grads, self._param_data, self.units = grads, param_data, units
        dp, rank = grads.dp.size, grads.dp.rank
        low_precision = param_data.dtype in (torch.bfloat16, torch.float16)
        # optim_grads_params with 16-bit parameters: the float32 shard is the main parameters
        self.main_is_shard = units is not None and units.param_dtype in (torch.bfloat16, torch.float16)
        # bf16 gradients (--grad-reduce-in-bf16) for float32 mains: a float32 copy at each step
        self._bf16_grads = shard_grads.dtype == torch.bfloat16 and (low_precision or self.main_is_shard)
        self._shard_grads = shard_grads
        self._grad_views: list[torch.Tensor] = []  # with _bf16_grads: each segment's in shard_grads
        self.pairs: list[tuple[torch.Tensor, nn.Parameter]] = []  # (model shard view, main)
        self.segment_mains: list[tuple[Segment, nn.Parameter]] = []  # (Segment, its main), for checkpoints
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for seg in grads.segments:
            model_view = seg.param.data.view(-1)[seg.lo : seg.hi] if units is None else units.shard_view(seg)
            main = nn.Parameter(model_view.detach().float().clone() if low_precision else model_view)
            view = shard_grads[seg.shard_offset : seg.shard_offset + (seg.hi - seg.lo)]
            if self._bf16_grads:
                self._grad_views.append(view)
            else:
                main.grad = view
            if low_precision:
                self.pairs.append((model_view, main))
            self.segment_mains.append((seg, main))
            (decay if seg.param.ndim >= 2 else no_decay).append(main)
        groups = [
            g
            for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ]
        # a rank whose shards hold only padding has nothing to update
        self.inner = adamw(groups, **adam_kwargs) if groups else None
        self._model_views = [view for view, _ in self.pairs]
        self._mains: list[torch.Tensor] = [main for _, main in self.pairs]
        self._shard_ranges = [
            (b.start + rank * (b.numel // dp), b.numel // dp, b.start, b.numel) for b in grads.buckets
        ]
        # buckets hold each chunk's parameters back to front: the next forward needs them in
        # chunk order, last bucket of a chunk first
        self._gather_order = sorted(range(len(grads.buckets)), key=lambda i: (grads.buckets[i].chunk, -i))
        self._pending: dict[int, Handle] = {}
        self.overlap = overlap_with is not None
        if overlap_with is not None:
            self._install_hooks(overlap_with)

    def _install_hooks(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        index = {id(p): i for i, b in enumerate(self.grads.buckets) for p in b.params}
        covered = {id(p) for _, params in units for p in params}
        missing = [i for i in index if i not in covered]
        if missing:
            raise ValueError(f"overlap_param_gather: {len(missing)} parameters belong to no module that waits for them")
        for module, params in units:
            buckets = tuple(sorted({index[id(p)] for p in params if id(p) in index}))
            if buckets:
                module.register_forward_pre_hook(lambda _m, _args, buckets=buckets: self._wait(buckets))

    def _wait(self, buckets) -> None:
        for i in buckets:
            work = self._pending.pop(i, None)
            if work is not None:
                work.wait()

    def wait_for_params(self) -> None:
        """Finish every parameter all-gather still in flight (sharded parameters: gather all)."""
        if self.units is not None:
            self.units.gather_all()
            return
        self.finish_gathers()

    def finish_gathers(self) -> None:
        """Finish the all-gathers the last step started and no forward waited for (they write
        this rank's shard of the parameters); none with ``units``."""
        self._wait(list(self._pending))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups if self.inner is not None else []

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    @torch.no_grad()
    def update(self, skip: torch.Tensor | None = None) -> None:
        """Update this rank's shard of the main parameters (unless ``skip``:
        :func:`~ptdp.engine.optim.adamw.step_unless`), after :meth:`finish_gathers`: no copy into
        16-bit parameters, no all-gather."""
        if not self._bf16_grads or not self.segment_mains:
            step_unless(self.inner, skip)
            return
        mains = [main for _, main in self.segment_mains]
        with float32_grads(mains, self._shard_grads, self._grad_views, self.grads.step_scale):
            step_unless(self.inner, skip)

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> None:
        """Update this rank's shard (unless the 0-dim bool tensor ``skip`` is true, decided on the
        device: :func:`~ptdp.engine.optim.adamw.step_unless`), then all-gather every bucket's parameters
        from all dp ranks (finished here, or with ``overlap_with`` during the next forward). With
        ``units`` the shard is the parameters: no all-gather, the gathered copies are freed."""
        if self.units is not None:
            self.update(skip)
            if self._mains:
                torch._foreach_copy_(self._model_views, self._mains)
            self.units.invalidate()
            return
        self.finish_gathers()  # a bucket no forward used (no parameter ran) is still in flight
        self.update(skip)
        if self._mains:
            torch._foreach_copy_(self._model_views, self._mains)
        data = self._param_data
        for i in self._gather_order:
            shard_start, per, start, numel = self._shard_ranges[i]
            mine = data[shard_start : shard_start + per].clone()
            self._pending[i] = all_gather_async(data[start : start + numel], mine, self.grads.dp, tag="params")
        if not self.overlap:
            self.wait_for_params()
