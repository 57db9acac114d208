"""What the planner evaluates (a :class:`Candidate`) and what it predicts for it (a :class:`Plan`).

Units: bytes, seconds, FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptdp.config.parallel import ParallelConfig
from ptdp.config.schema import Config
from ptdp.layout.pipeline.timing import StageTimes
from ptdp.planner.splits import accounting_of, split_flags

RECOMPUTE = ("none", "selective", "full")
#: torchtitan's per-op selective activation checkpointing (``selective_ac_option = "op"``): planned
#: when asked for (``--selective-ac-option op``), never searched; ``ptdp train`` does not run it
OP_SAC = "op"
#: Megatron-Core's ``--recompute-modules`` of a dense model (with selective recompute; default
#: core_attn); its MoE and MLA modules do not apply to the models ptdp plans
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
MOE_RECOMPUTE_MODULES = ("moe_act", "moe", "shared_experts", "mla_up_proj")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
#: ``--fp8-recipe``'s values: how ``ptdp train`` scales its FP8 GEMMs' operands
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
#: the optimizer state's default dtypes: float32 main parameters and Adam moments
OPTIMIZER_DTYPES = ("fp32", "fp32", "fp32")
#: bytes per value of the optimizer state's dtypes (``--main-params-dtype``, ``--exp-avg-dtype``, ...)
STATE_DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}
#: ``--params-dtype`` as the planner's precision (float64 is not planned)
PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Candidate:
    """One way to run a model on a cluster: the parallel config ``ptdp train`` runs, its resolved
    pipeline, and the batch, recompute and precision.

    Attributes:
        parallel: the layout as ``ptdp train`` takes it, resolved: ``data_parallel_size`` set, the
            sharding strategy explicit (``use_distributed_optimizer`` following it), v in
            ``virtual_pipeline_model_parallel_size`` (None: 1), an uneven split in its flags.
        micro_batch_size: b; global_batch_size: B; m = B / (b * dp) microbatches per step.
        recompute: "none", "selective" (attention scores), "full" (each layer's input kept) or
            "op" (torchtitan's per-op selective checkpointing, :data:`OP_SAC`).
        precision: "bf16", "fp16" (mixed precision with fp32 main weights), "fp32", or "fp8" (bf16
            mixed precision with FP8 weight GEMMs, :mod:`ptdp.planner.memory.fp8`).
        fp8_recipe: the FP8 GEMMs as ``ptdp train`` runs them under this ``--fp8-recipe``
            (:data:`FP8_RECIPES`; with any precision: the parameters' dtype is the precision's, bf16
            for "fp8"); None: no FP8 GEMMs, or with "fp8" Transformer Engine's as Megatron-Core runs
            them (delayed scaling; the published runs).
        virtual_stages: v model chunks per pipeline rank (interleaved 1F1B when > 1, unless the
            parallel config names another schedule: zb-v and dualpipev run 2 on the V placement).
        layer_split: layers per pipeline stage as ``parallel`` gives them (None: even).
        fp8_param_gather: with "fp8", the FP8 GEMMs' weights kept in FP8 (Megatron-LM's
            ``--fp8-param-gather``, :mod:`ptdp.planner.memory.fp8`).
        recompute_modules: with "selective", the modules recomputed (:data:`RECOMPUTE_MODULES`;
            empty: core_attn, Megatron-Core's default).
        optimizer_dtypes: (main parameters, first moment, second moment) dtypes of the optimizer
            state (Megatron-Core's precision-aware optimizer, ``--main-params-dtype``,
            ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``; :data:`OPTIMIZER_DTYPES`); all fp32 by default.
    """

    parallel: ParallelConfig
    micro_batch_size: int
    global_batch_size: int
    recompute: str = "none"
    precision: str = "bf16"
    virtual_stages: int = 1
    layer_split: tuple[int, ...] | None = None
    fp8_param_gather: bool = False
    recompute_modules: tuple[str, ...] = ()
    optimizer_dtypes: tuple[str, str, str] = OPTIMIZER_DTYPES
    fp8_recipe: str | None = None

    @classmethod
    def of(
        cls,
        tp: int,
        pp: int,
        dp: int,
        micro_batch_size: int,
        global_batch_size: int,
        virtual_stages: int = 1,
        recompute: str = "none",
        sequence_parallel: bool = False,
        distributed_optimizer: bool = False,
        precision: str = "bf16",
        layer_split: tuple[int, ...] | None = None,
        cp: int = 1,
        sharding: str | None = None,
        cp_comm_type: str = "p2p",
        ddp_bucket_size: int | None = None,
        overlap_grad_reduce: bool = True,
        reshard_after_forward: bool = True,
        schedule: str | None = None,
        grad_reduce_in_bf16: bool = False,
        fp8_param_gather: bool = False,
        recompute_modules: tuple[str, ...] = (),
        optimizer_dtypes: tuple[str, str, str] = OPTIMIZER_DTYPES,
        ep: int = 1,
        etp: int = 1,
        dispatcher: str = "alltoall",
        fp8_recipe: str | None = None,
    ) -> Candidate:
        """The candidate of these choices (``sharding``: the strategy, else ``optim`` with
        ``distributed_optimizer``, else ``no_shard``; ``layer_split`` at ``virtual_stages`` > 1: the
        split with the embedding and/or loss counted as layers, :func:`~ptdp.planner.splits.accounting_of`)."""
        strategy = sharding or ("optim" if distributed_optimizer else "no_shard")
        counted = accounting_of(layer_split, virtual_stages) if virtual_stages > 1 and layer_split else None
        parallel = ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            data_parallel_size=dp,
            context_parallel_size=cp,
            cp_comm_type=cp_comm_type,  # type: ignore[arg-type]
            pipeline_layer_split=layer_split if counted is None else None,
            account_for_embedding_in_pipeline_split=bool(counted and counted[0]),
            account_for_loss_in_pipeline_split=bool(counted and counted[1]),
            pipeline_schedule=schedule or ("interleaved-1f1b" if virtual_stages > 1 else "1f1b"),  # type: ignore[arg-type]
            virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None,
            sequence_parallel=sequence_parallel,
            ddp_bucket_size=ddp_bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=strategy != "no_shard",
            data_parallel_sharding_strategy=strategy,  # type: ignore[arg-type]
            reshard_after_forward=reshard_after_forward,
            grad_reduce_in_bf16=grad_reduce_in_bf16,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            moe_token_dispatcher_type=dispatcher,  # type: ignore[arg-type]
        )
        return cls(
            parallel,
            micro_batch_size,
            global_batch_size,
            recompute,
            precision,
            virtual_stages,
            layer_split,
            fp8_param_gather,
            tuple(recompute_modules) if recompute == "selective" else (),
            tuple(optimizer_dtypes),  # type: ignore[arg-type]
            fp8_recipe,
        )

    def fields(self) -> dict[str, Any]:
        """The candidate's choices by name, as ``ptdp plan --json`` lists them (``schedule``: the
        pipeline schedule it runs)."""
        p = self.parallel
        return {
            "tp": p.tp,
            "pp": p.pp,
            "dp": p.dp,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "virtual_stages": self.virtual_stages,
            "recompute": self.recompute,
            "sequence_parallel": p.sequence_parallel,
            "distributed_optimizer": p.use_distributed_optimizer,
            "precision": self.precision,
            "layer_split": self.layer_split,
            "cp": p.cp,
            "sharding": p.sharding_strategy,
            "cp_comm_type": p.cp_comm_type,
            "ddp_bucket_size": p.ddp_bucket_size,
            "overlap_grad_reduce": p.overlap_grad_reduce,
            "reshard_after_forward": p.reshard_after_forward,
            "grad_reduce_in_bf16": p.grad_reduce_in_bf16,
            "fp8_param_gather": self.fp8_param_gather,
            "recompute_modules": self.recompute_modules,
            "optimizer_dtypes": self.optimizer_dtypes,
            "ep": p.ep,
            "etp": p.etp,
            "dispatcher": p.moe_token_dispatcher_type,
            "fp8_recipe": self.fp8_recipe,
            "schedule": p.schedule,
        }

    def replace(self, **changes: Any) -> Candidate:
        """This candidate with some of :meth:`fields` changed (1f1b and interleaved-1f1b, the
        schedules v implies, follow a new v)."""
        given = self.fields()
        if "distributed_optimizer" in changes and "sharding" not in changes:
            given["sharding"] = None
        if given["schedule"] in ("1f1b", "interleaved-1f1b"):
            given["schedule"] = None
        given.update(changes)
        return Candidate.of(**given)

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def cp(self) -> int:
        return self.parallel.cp

    @property
    def ep(self) -> int:
        return self.parallel.ep

    @property
    def etp(self) -> int:
        return self.parallel.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``tp cp dp / (ep etp)`` ranks hold the same experts."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def sharding_strategy(self) -> str:
        return self.parallel.sharding_strategy

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules selective recompute runs again (core_attn by default); () otherwise."""
        if self.recompute != "selective":
            return ()
        return self.recompute_modules or ("core_attn",)

    @property
    def fp8(self) -> bool:
        """The layers' weight GEMMs run in FP8 (precision "fp8", or an :attr:`fp8_recipe`)."""
        return self.precision == "fp8" or self.fp8_recipe is not None

    @property
    def bf16_grads(self) -> bool:
        """Gradients kept and reduced in bf16 (``--grad-reduce-in-bf16``)."""
        return self.parallel.grad_reduce_in_bf16

    @property
    def optimizer_state(self) -> tuple[float, float, float] | None:
        """Bytes of (main parameter, first moment, second moment) per parameter with a
        precision-aware optimizer (:attr:`optimizer_dtypes` not all fp32), else None (the default
        float32 state)."""
        if self.optimizer_dtypes == OPTIMIZER_DTYPES:
            return None
        main, first, second = (STATE_DTYPE_BYTES[d] for d in self.optimizer_dtypes)
        return main, first, second

    @property
    def grad_bytes(self) -> float:
        """Bytes of one gradient element in the buffer and its data-parallel reduction."""
        return 2.0 if self.parallel.grad_reduce_in_bf16 else 4.0

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_size(self) -> int:
        """Ranks over which sharded state is split: ``dp * cp`` (parameters are replicated over cp
        as over dp; gradients are reduced over both)."""
        return self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def run_candidate(config: Config, precision: str | None = None) -> Candidate | None:
    """The candidate a resolved ``ptdp train`` config runs: its parallel config and pipeline as they
    are, its batch, its recompute granularity (the planner's ``full`` keeps every layer's input),
    ``precision`` (default: its ``params_dtype``'s, :data:`PRECISION_OF_DTYPE`, "fp8" for bfloat16
    with ``--fp8-format``; None for a dtype the planner does not model) and its ``--fp8-recipe``
    with ``--fp8-format``."""
    precision = precision or PRECISION_OF_DTYPE.get(config.model.params_dtype)
    if precision is None:
        return None
    recipe = config.fp8.fp8_recipe if config.fp8.enabled else None
    if recipe is not None and precision == "bf16":
        precision = "fp8"
    t, split = config.train, config.pipeline
    return Candidate(
        config.parallel,
        t.micro_batch_size,
        t.global_batch_size,
        config.model.recompute_granularity or "none",
        precision,
        split.virtual_stages,
        split.layer_split,
        fp8_recipe=recipe,
    )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded GPU (the pipeline stage with the largest total)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    stage: int = 0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one optimizer step; ``step`` is the predicted wall time, the others its parts.

    compute: forward + backward on the busiest stage over all microbatches; recompute: the extra
    forward of recomputation; tp_comm / pp_comm / cp_comm: exposed tensor-, pipeline-, context-parallel
    communication; bubble: pipeline fill and drain; dp_comm: exposed data-parallel reduction (and, when
    sharded, parameter all-gathers); optimizer: the update; core_sharing: the wait of more workers than
    CPU cores on a machine (0 on GPUs).
    """

    compute: float
    recompute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    core_sharing: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0
    edp_comm: float = 0.0

    @property
    def step(self) -> float:
        return (
            self.ep_comm
            + self.edp_comm
            + self.compute
            + self.recompute
            + self.tp_comm
            + self.pp_comm
            + self.bubble
            + self.dp_comm
            + self.optimizer
            + self.core_sharing
            + self.cp_comm
        )


@dataclass
class Plan:
    """The prediction for one layout; ``reasons`` say why it does not fit or cannot run.

    ``tflops_per_gpu`` is in TFLOP/s (1e12 FLOP/s), as the papers and ``--json`` report it; the
    :class:`~ptdp.planner.time.step_time.Performance` it comes from keeps FLOP/s. ``passes``: its
    F, B, W and p2p seconds of one microbatch on a middle pipeline rank, what ``ptdp schedule
    --times-from`` builds ``auto`` from (None without a pipeline or a time).
    """

    layout: Candidate
    fits: bool
    memory: MemoryBreakdown | None = None
    time: TimeBreakdown | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    reasons: list[str] = field(default_factory=list)
    passes: StageTimes | None = None

    def need_memory(self) -> MemoryBreakdown:
        """``memory`` (every fitting plan and every plan rejected for memory has it).

        Raises:
            ValueError: naming the layout, for a plan rejected before its memory was predicted.
        """
        if self.memory is None:
            raise ValueError(f"no memory prediction for {self.layout} (rejected: {'; '.join(self.reasons)})")
        return self.memory

    def need_time(self) -> TimeBreakdown:
        """``time`` (every fitting plan has it).

        Raises:
            ValueError: naming the layout, for a rejected plan, which has no step time.
        """
        if self.time is None:
            raise ValueError(f"no step-time prediction for {self.layout} (rejected: {'; '.join(self.reasons)})")
        return self.time

    def to_json(self) -> dict:
        """The ``--json`` record: layout fields (with ``cp`` and ``sharding``), fits, memory_bytes, time_s,
        tflops_per_gpu, mfu, pass_times_s (``passes``, null without a pipeline), reasons."""
        out = self.layout.fields()
        out["layer_split_flags"] = split_flags(self.layout.layer_split, self.layout.virtual_stages)  # null: even
        out["fits"] = self.fits
        out["memory_bytes"] = (
            {
                **{k: getattr(self.memory, k) for k in ("params", "grads", "optimizer", "activations", "overhead")},
                "total": self.memory.total,
            }
            if self.memory
            else None
        )
        out["time_s"] = (
            {
                **{
                    k: getattr(self.time, k)
                    for k in (
                        "compute",
                        "recompute",
                        "tp_comm",
                        "pp_comm",
                        "bubble",
                        "dp_comm",
                        "optimizer",
                        "core_sharing",
                        "cp_comm",
                        "ep_comm",
                        "edp_comm",
                    )
                },
                "step": self.time.step,
            }
            if self.time
            else None
        )
        out["tflops_per_gpu"] = self.tflops_per_gpu
        out["mfu"] = self.mfu
        out["pass_times_s"] = (
            {k: getattr(self.passes, k) for k in ("forward", "backward_input", "backward_weight", "p2p")}
            if self.passes
            else None
        )
        out["reasons"] = list(self.reasons)
        return out
