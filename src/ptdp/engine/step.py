"""One training step and one evaluation of a pipeline stage.

A step: zero the gradient buffer -> run the pipeline schedule over the rank's ``m`` microbatches ->
average gradients over dp (sum over cp) and sum the tied embedding over first/last stage ->
global-norm clip -> AdamW with the scheduled learning rate. The loss is the mean over all
``B * s`` tokens of the global batch, identical for every layout.

A step whose loss or gradient norm is nan or inf on any rank, or whose float16 gradients
overflow (flags carried by the world all-reduce of the loss), is skipped on every rank, changing
nothing (the 1-bit residual is restored). The host never waits for the device inside a step:
the norm, clip coefficient, skip decision and float16 loss scale stay on the device;
:class:`PendingStep` is read when logged.

With ``enable_optimizer_post_validation`` the gradient norm's square and the flags travel in one
world all-reduce, started before the optimizers update optimistically and awaited after; a wrong
update is then rolled back and redone (:mod:`ptdp.engine.optim.post_validation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.nn.functional as F

from ptdp.engine import activity
from ptdp.engine.comm import Handle, all_reduce, all_reduce_async
from ptdp.engine.data_parallel.grads import (
    clip_coefficient,
    clip_grads,
    finalize_grads,
    global_grad_norm,
    grad_norm_share,
)
from ptdp.engine.hooks import STEP_HOOKS
from ptdp.engine.moe.layer import MoELayer
from ptdp.engine.optim.adamw import set_lr, step_unless
from ptdp.engine.optim.post_validation import Snapshot, step_optimistically
from ptdp.engine.pipeline.runtime import Microbatch, run_schedule
from ptdp.engine.stage import Stage
from ptdp.engine.tensor_parallel.linear import end_fp8_step
from ptdp.layout.lr_schedule import lr_at
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.program import build_programs

NONFINITE_LOSS = "non-finite loss"
#: the names of an MoE step's scalar metrics (:attr:`StepResult.moe`), in their order after the five
#: others; then, with expert biases, :data:`MOE_BIAS_METRICS`
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_max_load", "moe_max_rank_load")
MOE_BIAS_METRICS = ("moe_expert_bias_min", "moe_expert_bias_max")
NONFINITE_GRAD_NORM = "non-finite gradient norm"
FP16_OVERFLOW = "float16 overflow"


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss (nats per token) over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping, of the unscaled gradients with float16 (inf/nan when a
    gradient it counts is; an overflow it does not count still skips the step: ``skip_reason``)."""
    lr: float
    skipped: bool = False
    """No update on any rank (see ``skip_reason``)."""
    loss_scale: float | None = None
    """The loss scale this step multiplied its loss by (float16 only; the next step's is halved
    after a skip)."""
    skip_reason: str | None = None
    """:data:`NONFINITE_LOSS` or :data:`NONFINITE_GRAD_NORM` (on some rank), or
    :data:`FP16_OVERFLOW`: float16 gradients overflowed at a loss scale that can still be halved
    (the scaler's ordinary business, not a failure)."""
    moe: dict[str, Any] | None = None
    """Mixture-of-experts models: ``moe_aux_loss`` and ``moe_z_loss`` (summed over the MoE layers,
    each the mean over the step's micro-batches), ``moe_dropped_fraction`` (of all routed
    assignments), ``moe_max_load`` and ``moe_max_rank_load`` (the most loaded expert's, and ep
    rank's, load over the mean, the largest over the layers, loads over the global batch), with
    expert biases ``moe_expert_bias_min``/``max`` (over every layer, as the step routed), and
    ``moe_tokens_per_expert``: ``{layer: [E] assignments}`` over the global batch per MoE layer."""

    @property
    def nonfinite(self) -> bool:
        """Skipped because the loss or the gradient norm was not finite."""
        return self.skip_reason in (NONFINITE_LOSS, NONFINITE_GRAD_NORM)


@dataclass(frozen=True)
class MoEValues:
    """How an MoE step's values continue after the five others: the scalars ``names``, then the
    ``[len(layers), experts]`` tokens per expert of the MoE layers ``layers`` (global indices)."""

    names: tuple[str, ...]
    layers: tuple[int, ...]
    experts: int

    def parse(self, row: list[float]) -> dict[str, Any]:
        n, e = len(self.names), self.experts
        out: dict[str, Any] = dict(zip(self.names, row[:n]))
        table = row[n:]
        out["moe_tokens_per_expert"] = {
            str(layer): [int(v) for v in table[i * e : (i + 1) * e]] for i, layer in enumerate(self.layers)
        }
        return out


class PendingStep:
    """What :func:`train_step` returns: the step's metrics while they are still on the device.

    ``values``: float64 ``[5]`` on the device, equal on every rank: mean loss, gradient norm before
    clipping, ranks with a non-finite loss, ranks with a non-finite norm (float16: or inf/nan
    gradients), loss scale used (1 without a scaler); an MoE step's continue as ``moe`` says. Read
    to the host only by :meth:`result` or :func:`read_results`. ``min_scale``: the float16 scaler's
    smallest scale (None without one), telling :data:`FP16_OVERFLOW` from :data:`NONFINITE_GRAD_NORM`.
    """

    def __init__(
        self, values: torch.Tensor, lr: float, min_scale: float | None = None, moe: MoEValues | None = None
    ) -> None:
        self.values, self.lr, self.min_scale, self.moe = values, lr, min_scale, moe
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's :class:`StepResult` (reads ``values`` to the host once: a synchronisation)."""
        if self._result is None:
            return read_results([self])[0]
        return self._result

    def _resolve(self, row: list[float]) -> None:
        loss, norm, bad_losses, bad_norms, scale = row[:5]
        moe = self.moe.parse(row[5:]) if self.moe is not None else None
        scaled = self.min_scale is not None
        reason = None
        if bad_losses or not math.isfinite(loss):
            reason = NONFINITE_LOSS
        elif bad_norms or not math.isfinite(norm):  # float16: halving the scale is the remedy, unless it can't
            reason = FP16_OVERFLOW if self.min_scale is not None and scale > self.min_scale else NONFINITE_GRAD_NORM
        self._result = StepResult(
            loss=loss,
            grad_norm=norm,
            lr=self.lr,
            skipped=reason is not None,
            loss_scale=scale if scaled else None,
            skip_reason=reason,
            moe=moe,
        )

    loss = property(lambda self: self.result().loss)
    grad_norm = property(lambda self: self.result().grad_norm)
    skipped = property(lambda self: self.result().skipped)
    skip_reason = property(lambda self: self.result().skip_reason)
    loss_scale = property(lambda self: self.result().loss_scale)
    nonfinite = property(lambda self: self.result().nonfinite)


def read_results(steps: list[PendingStep]) -> list[StepResult]:
    """The results of ``steps``, reading every one not read yet to the host with one
    ``tolist()`` of their stacked values: one host synchronisation for all of them."""
    return read_results_with(steps)[0]


@overload
def read_results_with(steps: list[PendingStep], extra: torch.Tensor) -> tuple[list[StepResult], list[float]]: ...


@overload
def read_results_with(steps: list[PendingStep], extra: None = None) -> tuple[list[StepResult], None]: ...


def read_results_with(
    steps: list[PendingStep], extra: torch.Tensor | None = None
) -> tuple[list[StepResult], list[float] | None]:
    """:func:`read_results`, and the values of ``extra`` (a float64 ``[5]`` tensor on the steps'
    device, e.g. values reduced over ranks at log time) read in the same ``tolist()``: still one
    host synchronisation. Returns the results and ``extra``'s values (None without it)."""
    unread = [step for step in steps if step._result is None]
    values = [step.values for step in unread] + ([extra] if extra is not None else [])
    width = max((v.numel() for v in values), default=0)  # an MoE step's values are longer
    rows = torch.stack([F.pad(v, (0, width - v.numel())) for v in values]).tolist() if values else []
    for step, row in zip(unread, rows):
        step._resolve(row)
    return [step.result() for step in steps], (rows[-1] if extra is not None else None)


def train_step(stage: Stage, microbatches: list[Microbatch], iteration: int, tracer=None) -> PendingStep:
    """One optimizer step over this rank's ``m`` microbatches (collective over the whole world);
    ``iteration`` is 0-based. Skipped on every rank, without any change, when the loss or the
    gradient norm is not finite on some rank, or float16 gradients overflowed (module docstring).
    ``tracer`` (a :class:`ptdp.run.trace.Tracer`) times every action and phase; the
    :data:`ptdp.engine.hooks.STEP_HOOKS` run before the schedule. No host synchronisation: the
    optimizer skips through :func:`~ptdp.engine.optim.adamw.step_unless` (post-validated: rolls
    back through :class:`~ptdp.engine.optim.post_validation.Snapshot`).
    """
    cfg, g = stage.config, stage.groups
    activity.start_step(g.global_rank, iteration + 1)
    stage.grads.zero()
    stage.grads.exact = iteration < cfg.grad_compression_warmup
    experts = stage.expert_grads
    if experts is not None:
        experts.zero()
    programs = build_programs(cfg.parallel.schedule, g.pp.size, len(microbatches), stage.virtual_stages)
    scale = stage.scaler.scale if stage.scaler is not None else None  # 0-dim, updated after its last use
    # 1/dp folded into the loss: the dp reduction of the buffer is then a plain sum (prescaled)
    loss_factor = (1.0 if scale is None else scale) / (g.dp.size if stage.grads.prescaled else 1)
    stage.grads.grad_scale = loss_factor
    if experts is not None:
        experts.grad_scale = loss_factor
    residual = stage.grads.residual
    kept = residual.clone() if residual is not None else None  # put back if the step is skipped
    undo = [u for hook in STEP_HOOKS if (u := hook(g.global_rank, iteration + 1, stage.chunks[0])) is not None]
    try:
        losses = run_schedule(
            programs[g.pp.rank],
            stage.model,
            microbatches,
            pp=g.pp,
            hidden_shape=stage.hidden_shape,
            dtype=stage.dtype,
            device=stage.device,
            tracer=tracer,
            grad_sync=stage.grads,
            loss_scale=loss_factor,
            batch_shape=(cfg.train.micro_batch_size, cfg.model.seq_length),
            placement=placement_of(cfg.parallel.schedule),
        )
    finally:
        for u in undo:
            u()
    activity.set_phase(activity.GRAD_SYNC)
    span = tracer.span("grad sync + clip", "grad_sync") if tracer is not None else None
    finalize_grads(stage.model, stage.grads, g)
    end_fp8_step(stage.fp8_gemms, [g.tp, g.dp_cp])  # delayed scaling's history, on skipped steps too
    if experts is not None:
        experts.finish()
    overflow = None
    if stage.scaler is not None and scale is not None:  # scale: the scaler's
        overflow = stage.scaler.unscale(stage.grads.reduced, scale)
        if experts is not None:
            overflow = torch.maximum(overflow, stage.scaler.unscale(experts.reduced, scale))
    snapshots: list[Snapshot] = []
    if cfg.train.enable_optimizer_post_validation:  # update while the global state is all-reduced
        state, work = _start_global_state(stage, losses, overflow)
        if span is not None:
            span.end()
        snapshots = _step_optimistically(stage, lr_at(iteration, cfg.train), tracer)
        span = tracer.span("grad sync + clip", "grad_sync") if tracer is not None else None
        work.wait()
        values, norm = _global_state(stage, state, len(microbatches), scale)
    else:
        norm = global_grad_norm(stage.model, stage.grads, g, experts)
        values = _step_values(stage, losses, len(microbatches), norm, overflow, scale)
    loads = _moe_loads(stage) if cfg.moe.enabled else []  # for the metrics and the expert biases
    moe = None
    if cfg.moe.enabled:
        moe_values, moe = _moe_values(stage, len(microbatches), loads)
        values = torch.cat([values, moe_values])
    pending = PendingStep(
        values,
        lr_at(iteration, cfg.train),
        stage.scaler.min_scale if stage.scaler is not None else None,
        moe,
    )
    skip = (pending.values[2] + pending.values[3] > 0) | ~pending.values[0].isfinite()
    if stage.scaler is not None:
        stage.scaler.update(skip)
    if kept is not None and residual is not None:  # kept: a copy of the residual
        residual.copy_(torch.where(skip, kept, residual))
    step_skip = skip
    if snapshots:  # roll back a wrong optimistic update; the step below redoes it (clipped) or not
        redo = skip | (clip_coefficient(norm, cfg.train.clip_grad) != 1)
        for snapshot in snapshots:
            snapshot.restore(redo)
        step_skip = skip | ~redo
    clip_grads(stage.grads, norm, cfg.train.clip_grad)
    if experts is not None:
        clip_grads(experts, norm, cfg.train.clip_grad)
    activity.set_phase(activity.OPTIMIZER)
    if span is not None:
        span.end()
        span = tracer.span("optimizer", "optimizer")
    for optimizer in stage.optimizers:
        set_lr(optimizer, pending.lr)
        if isinstance(optimizer, torch.optim.Optimizer):
            step_unless(optimizer, step_skip)
        else:
            optimizer.step(step_skip)
    for layer, load in loads:  # expert biases, global_aux_loss's counts: no update on a skipped step
        layer.step_done(load, skip)
    if span is not None:
        span.end()
    return pending


@torch.no_grad()
def eval_loss(stage: Stage, batches: list[list[Microbatch]]) -> float:
    """Mean loss over ``batches`` (each this rank's microbatches of one global batch), no update,
    in eval mode (no dropout, nothing drawn from the dropout streams)."""
    stage.model.eval()
    try:
        return _eval_loss(stage, batches)
    finally:
        stage.model.train()


def _eval_loss(stage: Stage, batches: list[list[Microbatch]]) -> float:
    """Mean over ``batches`` of each global batch's mean loss, known on every rank: the last
    stages' loss sums stay on the device, then one world all-reduce of a single float64 (tag
    ``metrics``; only tp rank 0 of each last stage contributes, since its tp peers hold the same
    value; its cp peers add their shares of each microbatch's loss) and one read to the host per
    evaluation: the sum over dp x cp divided by dp."""
    g = stage.groups
    if not batches:
        return 0.0
    total = torch.zeros(1, dtype=torch.float64, device=stage.device)
    for microbatches in batches:
        placement = placement_of(stage.config.parallel.schedule)  # a V model evaluates on its V
        programs = build_programs(
            "forward-only", g.pp.size, len(microbatches), stage.virtual_stages, placement=placement
        )
        losses = run_schedule(
            programs[g.pp.rank],
            stage.model,
            microbatches,
            pp=g.pp,
            hidden_shape=stage.hidden_shape,
            dtype=stage.dtype,
            device=stage.device,
            forward_only=True,
            batch_shape=(stage.config.train.micro_batch_size, stage.config.model.seq_length),
            placement=placement,
        )
        if g.tp.rank == 0 and losses:  # losses: this rank runs the last virtual stage
            total += torch.stack(losses).to(torch.float64).sum() / len(microbatches)
    all_reduce(total, g.world, tag="metrics")
    return total.item() / (g.dp.size * len(batches))


def _step_values(
    stage: Stage,
    losses: list[torch.Tensor],
    m: int,
    norm: torch.Tensor,
    overflow: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[mean loss, norm, ranks with a non-finite loss, ranks with a non-finite norm or (float16)
    an ``overflow`` flag set, loss scale]``: float64 on the device, the same on every rank. One
    world all-reduce of three float64 (tag ``metrics``; only tp rank 0 of each last stage adds its
    loss sum, since its tp peers hold the same value; each cp rank adds its share of every
    microbatch's loss, so the sum over dp x cp divided by ``m * dp`` is the step's mean); the scale
    (1 without one) is appended after it. No host synchronisation."""
    value = _loss_sums(stage, losses, 3)
    bad_norm = ~norm.isfinite()
    value[2] = (bad_norm if overflow is None else bad_norm | (overflow > 0)).double()
    all_reduce(value, stage.groups.world, tag="metrics")
    return _values(stage, value, m, norm, scale)


def _loss_sums(stage: Stage, losses: list[torch.Tensor], n: int) -> torch.Tensor:
    """float64 ``[n]`` zeros on the device but ``[0]``, this rank's loss sum (tp rank 0 of a last
    stage only), and ``[1]``, 1 where one of ``losses`` is not finite."""
    g = stage.groups
    value = torch.zeros(n, dtype=torch.float64, device=stage.device)
    if losses:
        stacked = torch.stack(losses)
        value[1] = (~stacked.isfinite().all()).double()
        if g.tp.rank == 0:  # losses: this rank runs the last virtual stage
            value[0] = stacked.to(torch.float64).sum()
    return value


def _values(stage: Stage, value: torch.Tensor, m: int, norm: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """:class:`PendingStep`'s five values from the world-reduced ``value`` (loss sum and the two
    counts), ``norm`` and ``scale`` (1 without one)."""
    scale = torch.ones((), dtype=torch.float64, device=stage.device) if scale is None else scale.to(torch.float64)
    return torch.stack([value[0] / (m * stage.groups.dp.size), norm.to(torch.float64), value[1], value[2], scale])


def _step_optimistically(stage: Stage, lr: float, tracer) -> list[Snapshot]:
    """Post-validation: every optimizer's optimistic update at ``lr``
    (:func:`~ptdp.engine.optim.post_validation.step_optimistically`), traced as ``optimizer``;
    returns their snapshots."""
    activity.set_phase(activity.OPTIMIZER)
    span = tracer.span("optimizer", "optimizer") if tracer is not None else None
    snapshots = []
    for optimizer in stage.optimizers:
        set_lr(optimizer, lr)
        snapshots.append(step_optimistically(optimizer))
    if span is not None:
        span.end()
    activity.set_phase(activity.GRAD_SYNC)
    return snapshots


def _start_global_state(
    stage: Stage, losses: list[torch.Tensor], overflow: torch.Tensor | None
) -> tuple[torch.Tensor, Handle]:
    """Post-validation: ``[loss sum, ranks with a non-finite loss, ranks with a float16 overflow,
    sum of squares of the gradients]`` as float64 on the device, and the handle of its world
    all-reduce, started (tag ``metrics``; each rank adds its loss sum as in :func:`_step_values`
    and its :func:`~ptdp.engine.data_parallel.grads.grad_norm_share`)."""
    g = stage.groups
    value = _loss_sums(stage, losses, 4)
    if overflow is not None:
        value[2] = (overflow > 0).double()
    value[3] = grad_norm_share(stage.grads, g, stage.expert_grads)
    return value, all_reduce_async(value, g.world, tag="metrics")


def _global_state(
    stage: Stage, state: torch.Tensor, m: int, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of :func:`_step_values` from the all-reduced ``state`` of
    :func:`_start_global_state` (a non-finite norm counted on every rank, as there), and the
    gradient norm (float64 0-dim)."""
    norm = state[3].sqrt()
    bad = torch.where(norm.isfinite(), state[2], float(stage.groups.world.size))
    return _values(stage, torch.stack([state[0], state[1], bad]), m, norm, scale), norm


def _moe_loads(stage: Stage) -> list[tuple[MoELayer, torch.Tensor]]:
    """Each MoE layer of the stage that counted this step, with its loads over the global batch:
    ``[E]`` float64, its micro-batches' counts summed over dp (one dp all-reduce of every such
    layer's ``[E]``, tag ``moe_load``)."""
    layers = [mod for mod in stage.model.modules() if isinstance(mod, MoELayer)]
    counted = [(layer, layer.step_counts) for layer in layers if layer.step_counts is not None]
    if not counted:
        return []
    loads = torch.cat([counts.to(torch.float64) for _, counts in counted])
    all_reduce(loads, stage.groups.dp, tag="moe_load")
    return list(zip([layer for layer, _ in counted], loads.view(len(counted), -1)))


def _moe_values(stage: Stage, m: int, loads: list[tuple[MoELayer, torch.Tensor]]) -> tuple[torch.Tensor, MoEValues]:
    """The step's MoE values as float64 on the device, the same on every rank, and their
    :class:`MoEValues`: :data:`MOE_METRICS` (the losses' shares summed over the world over ``m dp``
    micro-batches; the drops counted by tp and cp rank 0, the micro-batch's, over the assignments;
    the largest max/mean over experts and over ep ranks of every layer's ``loads``), with expert
    biases :data:`MOE_BIAS_METRICS`, then every MoE layer's ``[E]`` loads (each stage's filled in,
    summed over pp). Communication: a world all-reduce of 4, a pp all-reduce of the layers' loads
    (tag ``moe_load``) and with expert biases a world max of 2."""
    g, cfg = stage.groups, stage.config
    e = cfg.moe.num_experts or 0
    layer_ids = tuple(i for i, on in enumerate(cfg.moe.moe_layers(cfg.model.num_layers)) if on)
    sums = torch.zeros(4, dtype=torch.float64, device=stage.device)
    table = torch.zeros(len(layer_ids), e, dtype=torch.float64, device=stage.device)
    if loads:
        step_sums = [layer.step_sums for layer, _ in loads if layer.step_sums is not None]
        sums[:2] = sum(part[:2] for part in step_sums)
        if g.tp.rank == 0 and g.cp.rank == 0:
            t = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.moe.moe_router_topk
            sums[2] = sum(part[2] for part in step_sums)
            sums[3] = float(len(loads) * m * t)
        for layer, load in loads:
            table[layer_ids.index(layer.layer_id)] = load
    all_reduce(sums, g.world, tag="metrics")
    all_reduce(table, g.pp, tag="moe_load")
    ep = cfg.parallel.ep
    mean = table.mean(dim=1).clamp(min=1e-30)
    per_rank = table.view(len(layer_ids), ep, e // ep).sum(2)
    max_load = max_rank_load = torch.zeros((), dtype=torch.float64, device=stage.device)
    if layer_ids:  # resolve() refuses a model without MoE layers; built directly, it reports 0
        max_load = (table.max(dim=1).values / mean).max()
        max_rank_load = (per_rank.max(dim=1).values / (mean * (e // ep))).max()
    values = [sums[0] / (m * g.dp.size), sums[1] / (m * g.dp.size), sums[2] / sums[3].clamp(min=1.0)]
    names: tuple[str, ...] = MOE_METRICS
    out = torch.stack([*values, max_load, max_rank_load])
    if cfg.moe.moe_router_enable_expert_bias:
        names = MOE_METRICS + MOE_BIAS_METRICS
        ends = torch.full((2,), -math.inf, dtype=torch.float64, device=stage.device)
        biases = [layer.expert_bias for layer, _ in loads if layer.expert_bias is not None]
        if biases:
            every = torch.cat(biases).to(torch.float64)
            ends = torch.stack([-every.min(), every.max()])
        all_reduce(ends, g.world, op="max", tag="metrics")
        out = torch.cat([out, torch.stack([-ends[0], ends[1]])])
    return torch.cat([out, table.reshape(-1)]), MoEValues(names, layer_ids, e)
