"""What the planner evaluates (a :class:`Layout`) and what it predicts for it (a :class:`Plan`).

Units: bytes, seconds, FLOP/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ptdp.planner.splits import split_flags

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
#: Megatron-Core's data-parallel sharding strategies, least sharded first (ZeRO stages 0-3)
SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
#: How context-parallel ranks exchange keys and values: a ring of point-to-point transfers, or
#: one all-gather per layer (Megatron-Core's ``--cp-comm-type`` p2p and all_gather)
CP_COMM_TYPES = ("p2p", "all_gather")


@dataclass(frozen=True)
class Layout:
    """One way to run a model on a cluster.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel sizes (tp * cp * pp * dp GPUs).
        micro_batch_size: b; global_batch_size: B; m = B / (b * dp) microbatches per step.
        virtual_stages: v model chunks per pipeline rank (interleaved 1F1B when > 1).
        recompute: "none", "selective" (attention scores) or "full" (each layer's input kept).
        sequence_parallel: LayerNorm/dropout regions split along the sequence over tp (Korthikanti
            et al. 2022); TP all-reduces become all-gather + reduce-scatter.
        distributed_optimizer: optimizer state (and fp32 main parameters) sharded (ZeRO-1); kept
            equal to ``sharding != "no_shard"``.
        precision: "bf16", "fp16" (mixed precision with fp32 main weights), "fp32", or "fp8" (bf16
            mixed precision with FP8 weight GEMMs, :mod:`ptdp.planner.memory.fp8`).
        layer_split: explicit layers per pipeline stage (None: even).
        cp: context-parallel size; the sequence is split into ``2 cp`` chunks, two per cp rank.
            Rank order tp-cp-dp-pp: a cp group is ``cp`` ranks at stride tp.
        sharding: data-parallel sharding strategy over the ``dp * cp`` ranks that hold the same
            parameters (:data:`SHARDING`); given, it sets ``distributed_optimizer``. Kept as None
            for ``no_shard`` and ``optim``, which ``distributed_optimizer`` tells apart, so equal
            layouts compare equal; :attr:`sharding_strategy` is the strategy.
        cp_comm_type: key/value exchange of context parallelism (:data:`CP_COMM_TYPES`).
        ddp_bucket_size: most gradient elements per data-parallel bucket (``--ddp-bucket-size``;
            None: 40 million, ptdp's and Megatron's default); with ``optim_grads`` and
            ``optim_grads_params`` it sets the gradient transient (:mod:`ptdp.planner.memory.transients`).
        overlap_grad_reduce: buckets reduced during backward as they fill (``--overlap-grad-reduce``,
            ptdp's default); without it a sharded-gradient backward holds all its buckets at its end.
        reshard_after_forward: ``optim_grads_params`` frees each unit's gathered parameters after
            its forward and gathers them again for its backward (ptdp's default); False
            (``--no-reshard-after-forward``) keeps a chunk's units gathered while it has a
            microbatch in flight: one all-gather per unit per stretch of such microbatches, the
            stage's parameters gathered at once.
    """

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    precision: str = "bf16"
    layer_split: tuple[int, ...] | None = None
    cp: int = 1
    sharding: str | None = None
    cp_comm_type: str = "p2p"
    ddp_bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.sharding is not None:  # the strategy decides; distributed_optimizer follows it
            object.__setattr__(self, "distributed_optimizer", self.sharding != "no_shard")
        if self.sharding in ("no_shard", "optim"):  # one spelling: distributed_optimizer says which
            object.__setattr__(self, "sharding", None)

    @property
    def sharding_strategy(self) -> str:
        """The data-parallel sharding strategy: ``sharding``, else ``optim`` with the distributed
        optimizer, else ``no_shard``."""
        if self.sharding is not None:
            return self.sharding
        return "optim" if self.distributed_optimizer else "no_shard"

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

    compute: forward + backward GEMMs and attention on the busiest stage over all microbatches;
    recompute: the extra forward of activation recomputation; tp_comm / pp_comm: exposed
    tensor-/pipeline-parallel communication; bubble: pipeline fill and drain; dp_comm: the part of
    the data-parallel gradient reduction not hidden behind backward; optimizer: the update;
    core_sharing: time added because more workers than CPU cores share a machine (0 on GPUs);
    cp_comm: exposed context-parallel key/value exchange (:mod:`ptdp.planner.time.cp_exchange`). With a
    sharded strategy dp_comm also holds the exposed gradient reduce-scatters and parameter
    all-gathers (:mod:`ptdp.planner.memory.strategies`).
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

    @property
    def step(self) -> float:
        return (
            self.compute
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
    :class:`~ptdp.planner.time.step.Performance` it comes from keeps FLOP/s.
    """

    layout: Layout
    fits: bool
    memory: MemoryBreakdown | None = None
    time: TimeBreakdown | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    reasons: list[str] = field(default_factory=list)

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
        """The ``--json`` record: layout fields (with ``cp`` and ``sharding``), fits, memory_bytes, time_s, tflops_per_gpu, mfu, reasons."""
        out = {k: v for k, v in asdict(self.layout).items()}
        out["sharding"] = self.layout.sharding_strategy
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
                    )
                },
                "step": self.time.step,
            }
            if self.time
            else None
        )
        out["tflops_per_gpu"] = self.tflops_per_gpu
        out["mfu"] = self.mfu
        out["reasons"] = list(self.reasons)
        return out
