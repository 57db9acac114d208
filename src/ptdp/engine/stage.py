"""A pipeline stage of one rank: its model chunks built and initialised (layout-independently)
for the resolved config, the gradient buffer of its data-parallel strategy, its optimizer and its
pipeline programs (:class:`Stage`, :func:`build_stage`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import cast

import torch

from ptdp.config.fields import SPLIT_BACKWARD_SCHEDULES
from ptdp.config.fp8 import FP8Config
from ptdp.config.schema import Config
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.loss_scale import DynamicLossScaler
from ptdp.engine.data_parallel.units import (
    ParamUnits,
    UnitUse,
    gradient_units,
    param_gather_units,
    sharding_units,
    unit_index,
)
from ptdp.engine.fp8 import FP8Recipe
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.compile import compile_stage
from ptdp.engine.model.gpt import DTYPES, GPTModel
from ptdp.engine.model.model_chunks import ModelChunks
from ptdp.engine.optim.adamw import MainParamsAdamW
from ptdp.engine.optim.factory import build_optimizer
from ptdp.engine.optim.zero import ShardedAdamW
from ptdp.engine.tensor_parallel.linear import FP8GEMMs, FP8Settings
from ptdp.engine.tensor_parallel.random import DropoutRNG
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.layout.pipeline.placement import virtual_stage


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
    expert_grads: GradBuffer | None = None
    """With expert parallelism: the routed experts' gradients, summed over the expert
    data-parallel group (``groups.edp``); :attr:`grads` holds the others."""
    expert_optimizer: torch.optim.Optimizer | MainParamsAdamW | ShardedAdamW | None = None
    """With :attr:`expert_grads`: AdamW over the routed experts (sharded over ``groups.edp`` with
    any sharding strategy); :attr:`optimizer` holds the others."""

    @property
    def optimizers(self) -> list:
        """The stage's optimizers: :attr:`optimizer`, then :attr:`expert_optimizer` if any."""
        return [self.optimizer] + ([self.expert_optimizer] if self.expert_optimizer is not None else [])

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.model.params_dtype]

    @property
    def chunks(self) -> list[GPTModel]:
        """This rank's model chunks in chunk order: the one stage, or the ``v`` chunks."""
        return [cast(GPTModel, c) for c in self.model] if isinstance(self.model, ModelChunks) else [self.model]

    @functools.cached_property
    def fp8_gemms(self) -> list[FP8GEMMs]:
        """The FP8 state of every linear layer of this rank, chunk by chunk (empty without FP8;
        found once, not at every step)."""
        return [gemms for chunk in self.chunks for gemms in chunk.fp8_gemms()]

    def wait_for_params(self) -> None:
        """With ``overlap_param_gather``: finish every parameter all-gather still in flight, so the
        parameters can be read outside a forward pass (the forward waits by itself); with
        ``optim_grads_params``: gather every unit (freed again by its next forward or the next
        optimizer step). Collective over the dp x cp group with sharded parameters."""
        for optimizer in self.optimizers:
            wait = getattr(optimizer, "wait_for_params", None)
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
    experts = groups.experts
    if experts is not None:
        experts = dataclasses.replace(experts, dispatcher=p.moe_token_dispatcher_type)
    # cp: each rank computes its chunks of the sequence
    chunks = [
        GPTModel(
            m,
            groups.tp,
            layer_ids=split.chunk_layer_ids(rank, c),
            pre_process=virtual_stage(rank, c, pp, split.placement) == 0,
            post_process=virtual_stage(rank, c, pp, split.placement) == pp * v - 1,
            sequence_parallel=p.sequence_parallel,
            rng=rng,
            cp=groups.cp,
            cp_comm_type=p.cp_comm_type,
            moe=config.moe if config.moe.enabled else None,
            experts=experts,
            fp8=fp8_settings(config.fp8),
            defer_wgrad=p.schedule in SPLIT_BACKWARD_SCHEDULES,
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
    _tie_on_rank(chunks)
    model = chunks[0] if v == 1 else ModelChunks(chunks)
    device = torch.device(device)
    allow_tf32(device)
    model.to(device)
    zero3 = p.sharding_strategy == "optim_grads_params"  # parameters sharded too, gathered unit by unit
    if m.compile:  # one graph per stage at tp = 1, else each layer's forward (collectives stay eager)
        for chunk in chunks:
            compile_stage(chunk, whole=not (p.overlap_param_gather or zero3))
    expert_grads = _expert_grads(config, groups, chunks)
    grads, optimizer = _data_parallel(config, groups, chunks, model, exclude=expert_grads)
    expert_optimizer = None
    if expert_grads is not None:
        expert_optimizer = build_optimizer(model, config.train, expert_grads, params=expert_grads.params)
    scaler = DynamicLossScaler(device=device) if m.params_dtype == "float16" else None
    return Stage(
        config,
        groups,
        model,
        optimizer,
        grads,
        device,
        scaler,
        dropout_rng=rng,
        expert_grads=expert_grads,
        expert_optimizer=expert_optimizer,
    )


def _tie_on_rank(chunks: list[GPTModel]) -> None:
    """Where one rank runs both the first and the last stage (the V placement's rank 0) with tied
    embeddings, its last chunk uses the first chunk's embedding module: one parameter, whose
    gradient sums both uses locally (no embedding-group all-reduce)."""
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process and c.tied_embedding() is not None]
    if first and last and first[0] is not last[0]:
        last[0].word_embeddings = first[0].word_embeddings


def fp8_settings(fp8: FP8Config) -> FP8Settings | None:
    """The linear layers' FP8 choices of a run (None without ``--fp8-format``)."""
    if fp8.fp8_format is None:
        return None
    recipe = FP8Recipe(
        format=fp8.fp8_format,
        recipe=fp8.fp8_recipe,
        margin=fp8.fp8_margin,
        amax_history_len=fp8.fp8_amax_history_len,
        amax_compute_algo=fp8.fp8_amax_compute_algo,
    )
    return FP8Settings(recipe, emulate=fp8.fp8_emulate)


def _expert_grads(config: Config, groups: ParallelGroups, chunks: list[GPTModel]) -> GradBuffer | None:
    """With ep or etp > 1, the routed experts' gradient buffer, reduced by a sum over ``groups.edp`` (the
    ranks holding the same experts; 1/dp is in the loss, as for the dense buffer); None otherwise
    or on a stage without MoE layers.

    Float32 main gradients for 16-bit parameters as the dense buffer. With any sharding strategy
    the buffer is reduce-scattered over edp and the optimizer state sharded (ZeRO-1); the expert
    gradients and parameters themselves stay whole on their rank (already split over ep x etp).
    Reduced at the end of the step, without overlap or compression."""
    if groups.ep_etp is None or groups.ep_etp.size == 1 or groups.edp is None:
        return None
    per_chunk = [[p for p in chunk.parameters() if hasattr(p, "ptdp_expert")] for chunk in chunks]
    per_chunk = [ps for ps in per_chunk if ps]
    if not per_chunk:
        return None
    m, p = config.model, config.parallel
    low_precision = DTYPES[m.params_dtype] in (torch.bfloat16, torch.float16)
    return GradBuffer(
        per_chunk,
        dp=groups.edp,
        average_over=groups.dp.size,
        grad_dtype=torch.bfloat16 if p.grad_reduce_in_bf16 else torch.float32 if low_precision else None,
        main_grad=low_precision,
        bucket_size=p.ddp_bucket_size,
        shard=p.sharding_strategy != "no_shard",
        prescaled=m.params_dtype != "float16",  # as the dense buffer
    )


def _data_parallel(
    config: Config,
    groups: ParallelGroups,
    chunks: list[GPTModel],
    model: GPTModel | ModelChunks,
    *,
    exclude: GradBuffer | None = None,
) -> tuple[GradBuffer, torch.optim.Optimizer | MainParamsAdamW]:
    """The stage's gradient buffer and optimizer for the run's data-parallel sharding strategy
    (with ``optim_grads_params`` the parameters become shards gathered unit by unit); the
    parameters of ``exclude`` (the experts' own buffer) stay out of the buffer."""
    m, p = config.model, config.parallel
    excluded = {id(param) for param in exclude.params} if exclude is not None else set()
    zero3 = p.sharding_strategy == "optim_grads_params"  # parameters sharded too, gathered unit by unit
    low_precision = DTYPES[m.params_dtype] in (torch.bfloat16, torch.float16)
    tied = model.tied_embedding()
    specs = [_without(u, excluded) for u in sharding_units(chunks)] if zero3 else []
    specs = [u for u in specs if u.params]
    grads = GradBuffer(
        # reduced (and sharded) over the dp x cp ranks holding these parameters: summed over cp,
        # averaged over dp (1/dp in the loss, or average_over=dp for float16)
        _chunk_params(chunks, excluded),
        dp=groups.dp_cp,
        average_over=groups.dp.size,
        # float32 main gradients for 16-bit parameters; bfloat16 ones with --grad-reduce-in-bf16
        grad_dtype=torch.bfloat16 if p.grad_reduce_in_bf16 else torch.float32 if low_precision else None,
        main_grad=low_precision,
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
        grads.watch([(mod, [q for q in ps if id(q) not in excluded]) for mod, ps in gradient_units(chunks)])
    if zero3:
        units = ParamUnits(grads, specs, chunks, reshard_after_forward=p.reshard_after_forward)
        optimizer = build_optimizer(model, config.train, grads, units=units)
    else:
        gather = None
        if p.overlap_param_gather:
            gather = [(mod, [q for q in ps if id(q) not in excluded]) for mod, ps in param_gather_units(chunks)]
        params = [q for q in model.parameters() if id(q) not in excluded]
        optimizer = build_optimizer(model, config.train, grads, param_gather_units=gather, params=params)
    return grads, optimizer


def _chunk_params(chunks: list[GPTModel], excluded: set[int]) -> list[list[torch.nn.Parameter]]:
    """Each chunk's parameters not in ``excluded`` (ids); one shared by two chunks (a tied
    embedding on one rank) only in the first."""
    seen = set(excluded)
    out = []
    for chunk in chunks:
        out.append([p for p in chunk.parameters() if id(p) not in seen])
        seen.update(id(p) for p in out[-1])
    return out


def _without(unit: UnitUse, excluded: set[int]) -> UnitUse:
    """``unit`` without the parameters in ``excluded`` (ids)."""
    return dataclasses.replace(unit, params=[q for q in unit.params if id(q) not in excluded])


def allow_tf32(device: torch.device) -> None:
    """On CUDA, let float32 matrix multiplications use TensorFloat-32 tensor cores
    (``torch.set_float32_matmul_precision("high")``: inputs rounded to 10 explicit mantissa bits,
    float32 accumulation and range; NVIDIA's A100/H100 datasheets give 8x the float32 rate). A
    process-wide setting; bfloat16, float16 and float64 GEMMs are unaffected, and nothing changes
    on the CPU."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def with_vocab(config: Config, vocab_size: int) -> Config:
    """``config`` with the model's vocabulary set to the tokenizer's real size."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab_size))
