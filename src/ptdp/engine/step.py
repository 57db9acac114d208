"""One training step and one evaluation of a pipeline stage: the core loop shared by ``ptdp train``,
the tests and the benchmarks.

A step: zero the gradient buffer -> run the pipeline schedule (gpipe, 1f1b or interleaved-1f1b) over the rank's ``m`` microbatches ->
average gradients over dp (summing over cp: each cp rank's loss is its share of the microbatch's,
so its gradients are partial) and sum the tied embedding over first/last stage -> global-norm clip ->
AdamW with the scheduled learning rate (on float32 main parameters for bfloat16 models). Its loss is the mean over all ``B * s`` tokens of the global
batch, identical for every layout.

A step whose loss or gradient norm is nan or inf on any rank is skipped on every rank: the flag
travels in the world all-reduce that also sums the loss, so all ranks decide alike at no extra
collective. Nothing changes then: parameters, Adam's moments and step count, float32 main
parameters (whole or sharded) and the 1-bit error-feedback residual (restored from a copy taken
before the step) keep their values. The learning rate follows the iteration number, whose
update is simply not applied.

The host never waits for the device inside a step, whatever the precision: the gradient norm,
the clip coefficient and the skip decision are tensors on the device, the fused AdamW kernel skips
the update itself (``found_inf``), and the loss and norm come back in a :class:`PendingStep` that
the trainer reads once per logged step (:func:`read_results`). float16's loss scale and count of
good steps are device tensors too (:class:`~ptdp.engine.data_parallel.loss_scale.DynamicLossScaler`):
an inf or nan in a rank's unscaled gradients is added to the count of non-finite gradient norms in
the same world all-reduce, the scale is updated by ``torch.where`` from the skip decision, and
whether a skip was float16's ordinary overflow (:data:`FP16_OVERFLOW`) is decided when the result
is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ptdp.config.schema import Config
from ptdp.engine import activity
from ptdp.engine.comm import all_reduce
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.grads import clip_grads, finalize_grads, global_grad_norm
from ptdp.engine.data_parallel.loss_scale import DynamicLossScaler
from ptdp.engine.data_parallel.units import (
    ParamUnits,
    gradient_units,
    param_gather_units,
    sharding_units,
    unit_index,
)
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.hooks import STEP_HOOKS
from ptdp.engine.model.compile import compile_stage
from ptdp.engine.model.gpt import DTYPES, GPTModel
from ptdp.engine.model.model_chunks import ModelChunks
from ptdp.engine.optim.adamw import MainParamsAdamW, set_lr, step_unless
from ptdp.engine.optim.factory import build_optimizer
from ptdp.engine.pipeline.runtime import Microbatch, run_schedule
from ptdp.engine.step_results import FP16_OVERFLOW as FP16_OVERFLOW
from ptdp.engine.step_results import NONFINITE_GRAD_NORM as NONFINITE_GRAD_NORM
from ptdp.engine.step_results import NONFINITE_LOSS as NONFINITE_LOSS
from ptdp.engine.step_results import PendingStep
from ptdp.engine.step_results import StepResult as StepResult
from ptdp.engine.step_results import read_results as read_results
from ptdp.engine.step_results import read_results_with as read_results_with
from ptdp.engine.tensor_parallel.random import DropoutRNG
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.layout.lr_schedule import lr_at
from ptdp.layout.pipeline.program import build_programs


@dataclass
class Stage:
    """Everything one rank needs to train its shard: model, optimizer, gradients, groups."""

    config: Config
    groups: ParallelGroups
    model: GPTModel | ModelChunks
    """One stage, or the v chunks of an interleaved rank."""
    optimizer: torch.optim.Optimizer | MainParamsAdamW
    grads: GradBuffer
    device: torch.device
    scaler: DynamicLossScaler | None = None
    """Dynamic loss scaling, for float16 parameters only."""
    dropout_rng: DropoutRNG | None = None
    """This rank's dropout streams (shared by its model chunks; saved in checkpoints)."""

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.model.params_dtype]

    def wait_for_params(self) -> None:
        """With ``overlap_param_gather``: finish every parameter all-gather still in flight, so the
        parameters can be read outside a forward pass (the forward waits by itself); with
        ``optim_grads_params``: gather every unit (freed again by its next forward or the next
        optimizer step). Collective over the dp x cp group with sharded parameters."""
        wait = getattr(self.optimizer, "wait_for_params", None)
        if wait is not None:
            wait()

    def params_written(self) -> None:
        """After parameters were written in place (a checkpoint loaded into them, following
        :meth:`wait_for_params`): with ``optim_grads_params`` keep this rank's shard of them."""
        units = getattr(self.optimizer, "units", None)
        if units is not None:
            units.take_shards()

    @property
    def virtual_stages(self) -> int:
        return self.config.pipeline.virtual_stages

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        """Activations passed between stages, sequence-first: ``[s/cp, b, h]`` (a cp rank's two
        chunks; ``[s, b, h]`` at cp = 1), ``[s/(cp tp), b, h]`` with sequence parallelism."""
        m, t, p = self.config.model, self.config.train, self.config.parallel
        rows = m.seq_length // (p.context_parallel_size * (p.tp if p.sequence_parallel else 1))
        return (rows, t.micro_batch_size, m.hidden_size)


def build_stage(config: Config, groups: ParallelGroups, device: torch.device | str = "cpu") -> Stage:
    """Build, initialise (layout-independently, from ``config.train.seed``) and place this rank's stage.

    ``config`` must be resolved (``ptdp.config.resolve``) and ``config.model.vocab_size`` the real
    vocabulary size.
    """
    m, p, split = config.model, config.parallel, config.pipeline
    pp, rank, v = groups.pp.size, groups.pp.rank, split.virtual_stages
    rng = DropoutRNG(
        config.train.seed,
        dp_rank=groups.dp.rank,
        tp_rank=groups.tp.rank,
        device=device,
        sequence_parallel=p.sequence_parallel,
        cp_rank=groups.cp.rank,
        cp_size=groups.cp.size,
        tp_size=groups.tp.size,
    )
    # cp: each rank computes its chunks of the sequence
    chunks = [
        GPTModel(
            m,
            groups.tp,
            layer_ids=split.chunk_layer_ids(rank, c),
            pre_process=rank == 0 and c == 0,
            post_process=rank == pp - 1 and c == v - 1,
            sequence_parallel=p.sequence_parallel,
            rng=rng,
            cp=groups.cp,
            cp_comm_type=p.cp_comm_type,
        )
        for c in range(v)
    ]
    for chunk in chunks:  # each chunk by its global parameter names: the same weights on every layout
        initialize_parameters(
            chunk,
            seed=config.train.seed,
            std=m.init_method_std,
            num_layers=m.num_layers,
            tp_rank=groups.tp.rank,
            tp_size=groups.tp.size,
        )
    model = chunks[0] if v == 1 else ModelChunks(chunks)
    device = torch.device(device)
    allow_tf32(device)
    model.to(device)
    zero3 = p.sharding_strategy == "optim_grads_params"  # parameters sharded too, gathered unit by unit
    if m.compile:  # one graph per stage at tp = 1, else each layer's forward (collectives stay eager)
        for chunk in chunks:
            compile_stage(chunk, whole=not (p.overlap_param_gather or zero3))
    grads, optimizer = _data_parallel(config, groups, chunks, model)
    scaler = DynamicLossScaler(device=device) if m.params_dtype == "float16" else None
    return Stage(config, groups, model, optimizer, grads, device, scaler, dropout_rng=rng)


def _data_parallel(
    config: Config, groups: ParallelGroups, chunks: list[GPTModel], model: GPTModel | ModelChunks
) -> tuple[GradBuffer, torch.optim.Optimizer | MainParamsAdamW]:
    """The stage's gradient buffer and optimizer for the run's data-parallel sharding strategy
    (with ``optim_grads_params`` the parameters become shards gathered unit by unit)."""
    m, p = config.model, config.parallel
    zero3 = p.sharding_strategy == "optim_grads_params"  # parameters sharded too, gathered unit by unit
    low_precision = DTYPES[m.params_dtype] in (torch.bfloat16, torch.float16)
    tied = model.tied_embedding()
    specs = sharding_units(chunks) if zero3 else []
    grads = GradBuffer(
        # reduced (and sharded) over the dp x cp ranks holding these parameters: summed over cp,
        # averaged over dp (1/dp in the loss, or average_over=dp for float16)
        [list(chunk.parameters()) for chunk in chunks],
        dp=groups.dp_cp,
        average_over=groups.dp.size,
        grad_dtype=torch.float32 if low_precision else None,
        bucket_size=p.ddp_bucket_size,
        overlap=p.overlap_grad_reduce,
        codec=p.grad_compression,
        shard=p.use_distributed_optimizer,
        deferred=(tied,) if tied is not None and groups.embedding.size > 1 else (),
        # 1/dp folded into the loss, except for float16: its backward keeps the whole loss scale
        # (dividing it by dp would let small float16 gradients underflow); its codecs divide
        prescaled=m.params_dtype != "float16",
        # ZeRO-2 and 3: only the shard between microbatches
        shard_grads=p.sharding_strategy in ("optim_grads", "optim_grads_params"),
        unit_of=unit_index(specs) if zero3 else None,  # ZeRO-3: a bucket never spans two units
    )
    if grads.grads_sharded:  # a bucket's memory is allocated when backward reaches its module's output
        grads.watch(gradient_units(chunks))
    if zero3:
        units = ParamUnits(grads, specs, chunks, reshard_after_forward=p.reshard_after_forward)
        optimizer = build_optimizer(model, config.train, grads, units=units)
    else:
        gather = param_gather_units(chunks) if p.overlap_param_gather else None
        optimizer = build_optimizer(model, config.train, grads, param_gather_units=gather)
    return grads, optimizer


def allow_tf32(device: torch.device) -> None:
    """On CUDA, let float32 matrix multiplications use TensorFloat-32 tensor cores
    (``torch.set_float32_matmul_precision("high")``: inputs rounded to 10 explicit mantissa bits,
    float32 accumulation and range; NVIDIA's A100/H100 datasheets give 8x the float32 rate). A
    process-wide setting; bfloat16, float16 and float64 GEMMs are unaffected, and nothing changes
    on the CPU (float64 equivalence tests run there)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def train_step(stage: Stage, microbatches: list[Microbatch], iteration: int, tracer=None) -> PendingStep:
    """One optimizer step over this rank's ``m`` microbatches (collective over the whole world);
    ``iteration`` is 0-based. Skipped on every rank, without any change, when the loss or the
    gradient norm is not finite on some rank, or float16 gradients overflowed (module docstring).
    ``tracer`` (a :class:`ptdp.run.trace.Tracer`) times every action and phase; the
    :data:`ptdp.engine.hooks.STEP_HOOKS` run before the schedule.

    No host synchronisation, float16 included: the clip coefficient, the skip decision and the
    loss scale stay on the device, the optimizer skips through its fused kernel
    (:func:`~ptdp.engine.optim.adamw.step_unless`), and the metrics come back as a :class:`PendingStep`
    that the caller reads when it logs.
    """
    cfg, g = stage.config, stage.groups
    activity.start_step(g.global_rank, iteration + 1)
    stage.grads.zero()
    stage.grads.exact = iteration < cfg.grad_compression_warmup
    programs = build_programs(cfg.parallel.schedule, g.pp.size, len(microbatches), stage.virtual_stages)
    scale = stage.scaler.scale if stage.scaler is not None else None  # 0-dim, updated after its last use
    # 1/dp folded into the loss: the dp reduction of the buffer is then a plain sum (prescaled)
    loss_factor = (1.0 if scale is None else scale) / (g.dp.size if stage.grads.prescaled else 1)
    stage.grads.grad_scale = loss_factor
    residual = stage.grads.residual
    kept = residual.clone() if residual is not None else None  # put back if the step is skipped
    first_chunk = stage.model[0] if isinstance(stage.model, ModelChunks) else stage.model
    undo = [u for hook in STEP_HOOKS if (u := hook(g.global_rank, iteration + 1, first_chunk)) is not None]
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
        )
    finally:
        for u in undo:
            u()
    activity.set_phase(activity.GRAD_SYNC)
    span = tracer.span("grad sync + clip", "grad_sync") if tracer is not None else None
    finalize_grads(stage.model, stage.grads, g)
    overflow = None
    if stage.scaler is not None and scale is not None:  # scale: the scaler's
        overflow = stage.scaler.unscale(stage.grads.reduced, scale)
    norm = global_grad_norm(stage.model, stage.grads, g)
    pending = PendingStep(
        _step_values(stage, losses, len(microbatches), norm, overflow, scale),
        lr_at(iteration, cfg.train),
        stage.scaler.min_scale if stage.scaler is not None else None,
    )
    skip = (pending.values[2] + pending.values[3] > 0) | ~pending.values[0].isfinite()
    if stage.scaler is not None:
        stage.scaler.update(skip)
    if kept is not None and residual is not None:  # kept: a copy of the residual
        residual.copy_(torch.where(skip, kept, residual))
    clip_grads(stage.grads, norm, cfg.train.clip_grad)
    activity.set_phase(activity.OPTIMIZER)
    if span is not None:
        span.end()
        span = tracer.span("optimizer", "optimizer")
    set_lr(stage.optimizer, pending.lr)
    if isinstance(stage.optimizer, torch.optim.Optimizer):
        step_unless(stage.optimizer, skip)
    else:
        stage.optimizer.step(skip)
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
        programs = build_programs("forward-only", g.pp.size, len(microbatches), stage.virtual_stages)
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
        )
        if g.is_last_stage and g.tp.rank == 0 and losses:
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
    g = stage.groups
    value = torch.zeros(3, dtype=torch.float64, device=stage.device)
    if losses:
        stacked = torch.stack(losses)
        value[1] = (~stacked.isfinite().all()).double()
        if g.is_last_stage and g.tp.rank == 0:
            value[0] = stacked.to(torch.float64).sum()
    bad_norm = ~norm.isfinite()
    value[2] = (bad_norm if overflow is None else bad_norm | (overflow > 0)).double()
    all_reduce(value, g.world, tag="metrics")
    scale = torch.ones((), dtype=torch.float64, device=stage.device) if scale is None else scale.to(torch.float64)
    return torch.stack([value[0] / (m * g.dp.size), norm.to(torch.float64), value[1], value[2], scale])


def with_vocab(config: Config, vocab_size: int) -> Config:
    """``config`` with the model's vocabulary set to the tokenizer's real size."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab_size))
