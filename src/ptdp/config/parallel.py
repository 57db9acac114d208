"""The parallel layout and the data-parallel engine's settings (a section of the configuration
schema, :mod:`ptdp.config.fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ptdp.config.fields import opt
from ptdp.layout.codecs import CodecChoice
from ptdp.layout.pipeline.partition import PipelineSplit, pipeline_split
from ptdp.layout.pipeline.placement import V_SCHEDULES, placement_of

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "auto"]
"""The values of ``--pipeline-schedule``."""


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel axes; 1 means the axis is not used."""

    tensor_model_parallel_size: int = opt(
        1,
        "--tensor-model-parallel-size",
        "tensor-parallel size: each layer's matrices split over TP ranks",
        "layout",
        aliases=("--tp",),
        metavar="TP",
        plan=True,
        cli_default=2,
    )
    """Tensor-parallel size t (``ptdp train``'s default: 2)."""
    pipeline_model_parallel_size: int = opt(
        1,
        "--pipeline-model-parallel-size",
        "pipeline-parallel size: layers split into PP stages",
        "layout",
        aliases=("--pp",),
        metavar="PP",
        plan=True,
        cli_default=2,
    )
    """Pipeline-parallel size p (``ptdp train``'s default: 2)."""
    data_parallel_size: int | None = opt(
        None,
        "--data-parallel-size",
        "data-parallel size (default: world size / (TP x CP x PP))",
        "layout",
        aliases=("--dp",),
        metavar="DP",
        plan=True,
    )
    """None: inferred as world_size / (tp * cp * pp)."""
    context_parallel_size: int = opt(
        1,
        "--context-parallel-size",
        "context-parallel size: each sequence split into "
        "2 x CP chunks, two per CP rank, keys and values exchanged over the CP ranks "
        "(world = TP x CP x PP x DP)",
        "layout",
        aliases=("--cp",),
        metavar="CP",
        plan=True,
    )
    """Context-parallel size c: each sequence is cut into ``2 c`` chunks and cp rank i holds chunks
    i and ``2c - 1 - i`` (causal load balance), so activations and attention FLOPs per rank are
    divided by c; keys and values travel over the cp group (ring or all-gather). World =
    tp * cp * pp * dp, order tp-cp-dp-pp; gradients are summed over cp and averaged over dp. Needs
    ``seq_length % (2 c) == 0``. ``ptdp train`` trains it (:mod:`ptdp.engine.context_parallel`),
    ``ptdp plan`` models it (:mod:`ptdp.planner.time.cp_exchange`)."""
    expert_model_parallel_size: int = opt(
        1,
        "--expert-model-parallel-size",
        "expert-parallel size: each MoE layer's experts split over EP ranks, tokens exchanged "
        "with them (experts use an etp x ep x edp x pp grid over the same ranks)",
        "layout",
        aliases=("--ep",),
        plan=True,
        metavar="EP",
    )
    """Expert-parallel size: the ``E`` routed experts of an MoE layer are split over ``ep`` ranks
    (``E / ep`` each) and tokens travel to them and back. The experts' own grid is ``etp x ep x
    edp x pp`` over the same ranks and stages as ``tp x cp x dp x pp`` (Megatron-Core's parallel
    folding), ``edp = world / (etp ep pp)``; expert gradients are averaged over edp."""
    expert_tensor_parallel_size: int = opt(
        1,
        "--expert-tensor-parallel-size",
        "expert tensor-parallel size: each expert's MLP split over ETP ranks (default 1)",
        "layout",
        aliases=("--etp",),
        plan=True,
        metavar="ETP",
    )
    """Each expert's fc1 split by columns and fc2 by rows over ``etp`` ranks (the fastest axis of
    the expert grid)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = opt(
        "alltoall",
        "--moe-token-dispatcher-type",
        "how tokens reach their experts' ranks: all-to-all of the routed tokens, or all-gather of "
        "every token over the expert grid; flex: Megatron-Core's deduplicating DeepEP / HybridEP "
        "exchange (ptdp plan only)",
        "layout",
        plan=True,
        plan_searched=False,
    )
    """``alltoall``: split counts, then the routed tokens, by ``all_to_all_single`` with uneven
    splits; ``allgather``: every rank gathers all tokens of its ep x etp group and keeps its
    experts' share; ``flex``: Megatron-Core's flex dispatcher (DeepEP or HybridEP, each token sent
    once per node and GPU holding its experts), planned by ``ptdp plan`` only."""
    cp_comm_type: Literal["p2p", "all_gather"] = opt(
        "p2p",
        "--cp-comm-type",
        "how context-parallel ranks exchange keys and values: a ring of point-to-point "
        "transfers overlapped with attention (p2p), or one all-gather per layer (all_gather); Megatron-Core's "
        "names (its a2a variants are not modelled)",
        "layout",
        plan=True,
    )
    """Key/value exchange of context parallelism: ``p2p`` (ring attention, cp - 1 steps each hidden
    behind one block's attention) or ``all_gather`` (one all-gather of K and V per layer); see
    :mod:`ptdp.planner.time.cp_exchange`. No effect with cp = 1. ``ptdp plan``: None means p2p."""
    pipeline_layer_split: tuple[int, ...] | None = opt(
        None,
        "--pipeline-layer-split",
        "explicit layers per pipeline stage, e.g. 3,3,2 (default: even split)",
        "layout",
        metavar="N,N,...",
        plan=True,
    )
    """Explicit layers per pipeline stage (pp entries summing to num_layers); None: even split
    (or the first/last stage counts below; not together with them)."""
    decoder_first_pipeline_num_layers: int | None = opt(
        None,
        "--decoder-first-pipeline-num-layers",
        "layers on the first pipeline stage; the other stages split the "
        "rest evenly (Megatron-LM's flag; not with --pipeline-layer-split or interleaving)",
        "layout",
        metavar="N",
        plan=True,
    )
    """Layers on the first pipeline stage, which also holds the embedding; the stages without a
    count of their own split the remaining layers evenly (must divide). None: no count of its own."""
    decoder_last_pipeline_num_layers: int | None = opt(
        None,
        "--decoder-last-pipeline-num-layers",
        "layers on the last pipeline stage; the other stages split the "
        "rest evenly (Megatron-LM's flag; not with --pipeline-layer-split or interleaving)",
        "layout",
        metavar="N",
        plan=True,
    )
    """Layers on the last pipeline stage, which also holds the output layer and the loss (see
    :func:`ptdp.layout.pipeline.partition.first_last_split`). None: no count of its own."""
    account_for_embedding_in_pipeline_split: bool = opt(
        False,
        "--account-for-embedding-in-pipeline-split",
        "count the input embedding as one layer when splitting "
        "layers over pipeline stages and model chunks (Megatron-LM's flag)",
        "layout",
        plan=True,
    )
    """The input embedding counts as one layer of the split: ``num_layers + 1`` (+ 1 with
    :attr:`account_for_loss_in_pipeline_split`) units over ``pp`` stages, or ``pp * v`` model chunks of
    ``num_layers_per_virtual_pipeline_stage`` units each (then the first chunk may hold only the
    embedding); see :func:`ptdp.layout.pipeline.partition.accounted_split`. Not with the explicit
    split flags above."""
    account_for_loss_in_pipeline_split: bool = opt(
        False,
        "--account-for-loss-in-pipeline-split",
        "count the output layer + loss as one layer when splitting "
        "layers over pipeline stages and model chunks (Megatron-LM's flag)",
        "layout",
        plan=True,
    )
    """The output layer and the loss count as one layer of the split (the last unit; the last model
    chunk may hold only them)."""
    pipeline_schedule: PipelineSchedule | None = opt(
        None,
        "--pipeline-schedule",
        "pipeline schedule (default: 1f1b, or interleaved-1f1b with model chunks: "
        "--num-layers-per-virtual-pipeline-stage, --virtual-pipeline-model-parallel-size > 1); "
        "zb-h1, zb-h2, zb-v, dualpipev: backward input and weight gradients apart (zb-v, dualpipev: "
        "two chunks per rank in a V); auto: ptdp schedule only for now",
        "layout",
        plan=True,
    )
    """gpipe, 1f1b or interleaved-1f1b; None: interleaved-1f1b when model chunks are asked for
    (``num_layers_per_virtual_pipeline_stage``, or ``virtual_pipeline_model_parallel_size`` > 1),
    else 1f1b. The zero-bubble kinds (zb-h1, zb-h2, zb-v, dualpipev, auto: B and W apart;
    zb-v and dualpipev with two chunks per rank in a V) pass the rules; ``ptdp train`` runs all
    but ``auto``."""
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None,
        "--num-layers-per-virtual-pipeline-stage",
        "layers per model chunk for the interleaved schedule: each rank holds num_layers / (PP x N) chunks",
        "layout",
        metavar="N",
        plan=True,
    )
    """Layers per model chunk; each rank then holds v = num_layers / (pp * this) chunks."""
    virtual_pipeline_model_parallel_size: int | None = opt(
        None,
        "--virtual-pipeline-model-parallel-size",
        "model chunks v per pipeline rank for the interleaved schedule (instead of "
        "--num-layers-per-virtual-pipeline-stage; both given, they must agree)",
        "layout",
        aliases=("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-stages"),
        metavar="V",
        plan=True,
    )
    """v, the model chunks per pipeline rank (Megatron-LM's name); None: from
    ``num_layers_per_virtual_pipeline_stage``, else 1. Each chunk holds ``(num_layers + counted) /
    (pp * v)`` layers."""
    sequence_parallel: bool = opt(
        False,
        "--sequence-parallel",
        "split the activations outside the tensor-parallel "
        "regions along the sequence over TP (needs TP > 1 and seq_length % TP == 0)",
        "layout",
        plan=True,
    )
    """Split the activations outside the tensor-parallel regions (norms, residual adds, the
    embedding output) along the sequence over tp, ``[b, s/tp, h]`` per rank (Korthikanti et al.
    2022, §4.2.2): the tp all-reduces become all-gathers and reduce-scatters of the same total,
    those activations take 1/tp of the memory, and pipeline transfers carry ``[b, s/tp, h]``.
    Needs tp > 1 and ``seq_length % tp == 0``."""
    distributed_timeout_minutes: float = opt(
        10.0,
        "--distributed-timeout-minutes",
        "timeout of every process group (fractions allowed): a worker that "
        "waits longer for another fails the job, naming the rank, phase and iteration (ptdp train without CUDA: 2)",
        "layout",
        metavar="MINUTES",
    )
    """Timeout of every process group, in minutes (fractions allowed): a collective or transfer
    that waits longer fails the job with a message naming the rank, phase and iteration instead of
    hanging. 10 as in Megatron-LM; ``ptdp train`` on a machine without CUDA defaults to 2."""
    ddp_bucket_size: int | None = opt(
        None,
        "--ddp-bucket-size",
        "most gradient elements per bucket (default: 40,000,000)",
        "dp",
        metavar="ELEMENTS",
        plan=True,
        plan_searched=False,
    )
    """Most gradient elements per data-parallel bucket; None: 40 million (Megatron's default)."""
    overlap_grad_reduce: bool = opt(
        True,
        "--overlap-grad-reduce",
        "start each bucket's data-parallel reduction "
        "during the last microbatch's backward (default; --no-overlap-grad-reduce: "
        "after the whole backward)",
        "dp",
        plan=True,
        plan_searched=False,
    )
    """Start each bucket's data-parallel reduction during the last microbatch's backward, as soon
    as all its gradients are ready (on by default: the reductions then hide behind the rest of
    backward; the result is the same either way). The tied embedding's bucket always waits for
    the sum over the first and last stage; unused parameters' buckets start after backward."""
    grad_reduce_in_bf16: bool = opt(
        False,
        "--grad-reduce-in-bf16",
        "keep the gradient buffer in bf16 and reduce it over dp in bf16 (Megatron-LM's flag; needs "
        "bf16 parameters): 2 bytes per gradient instead of 4, half the reduction traffic; the optimizer "
        "still updates fp32 main parameters from an fp32 copy made at its step",
        "dp",
        plan=True,
        plan_searched=False,
    )
    """bfloat16 gradient buffer (``main_grad``), accumulated over microbatches and reduced over
    dp x cp in bfloat16; the optimizer step converts this rank's reduced gradients (its shard when
    sharded) to float32 for the main parameters (a transient of 4 bytes per element). Megatron-LM's
    ``--grad-reduce-in-bf16`` (``DistributedDataParallelConfig.grad_reduce_in_fp32=False``)."""
    grad_compression: Literal["none", "fp16", "bf16", "1bit"] = opt(
        "none",
        "--grad-compression",
        "reduce gradients over dp in fp32 (none), 16 bits, or 1 bit with error feedback",
        "dp",
    )
    """Data-parallel gradient reduction in none (fp32), fp16, bf16 or 1bit (with error feedback)."""
    grad_compression_warmup_iters: int | None = opt(
        None,
        "--grad-compression-warmup-iters",
        "reduce the first N iterations exactly before compressing (default: "
        "--lr-warmup-iters for 1bit, 0 for fp16/bf16)",
        "dp",
        metavar="N",
    )
    """First iterations reduced exactly (fp32) before the codec starts; None: the learning-rate
    warmup for 1bit, 0 for fp16/bf16."""
    use_distributed_optimizer: bool = opt(
        False,
        "--use-distributed-optimizer",
        "shard Adam's state and fp32 main parameters over dp (ZeRO-1)",
        "dp",
        plan=True,
    )
    """Shard Adam's state (and float32 main parameters) over dp (ZeRO-1); the same as
    ``--data-parallel-sharding-strategy optim``."""
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = opt(
        None,
        "--data-parallel-sharding-strategy",
        "what is sharded over the dp x cp ranks: nothing, the optimizer "
        "state (optim = --use-distributed-optimizer, ZeRO-1), also the gradients (optim_grads, ZeRO-2) or also the "
        "parameters (optim_grads_params, ZeRO-3: each layer's parameters all-gathered before its forward and "
        "backward) (default: optim with --use-distributed-optimizer, else no_shard)",
        "dp",
        plan=True,
    )
    """Megatron-Core's names for what the data-parallel ranks (dp x cp) shard: ``no_shard``,
    ``optim`` (ZeRO-1, the distributed optimizer), ``optim_grads`` (ZeRO-2) and
    ``optim_grads_params`` (ZeRO-3; Rajbhandari et al. 2020). None: ``optim`` when
    ``use_distributed_optimizer`` is set, else ``no_shard`` (:attr:`sharding_strategy`). ``ptdp plan``
    models all four (:mod:`ptdp.planner.memory.breakdown`, :mod:`ptdp.planner.time.collectives`) and ``ptdp train`` trains
    them (:mod:`ptdp.engine.data_parallel.buffer`, :mod:`ptdp.engine.data_parallel.units`)."""
    reshard_after_forward: bool = opt(
        True,
        "--reshard-after-forward",
        "optim_grads_params: free each layer's gathered parameters after its forward and gather them "
        "again for its backward (default; --no-reshard-after-forward keeps them from forward to backward)",
        "dp",
        plan=True,
        plan_searched=False,
    )
    """With ``optim_grads_params``: free a unit's gathered parameters after its forward and gather
    them again before its backward (two all-gathers per unit and microbatch, one of the embeddings'
    unit, which backward does not read; FSDP2's and
    Megatron-Core's ``reshard_after_forward``). False keeps them gathered from a chunk's forward
    until no microbatch of it is in flight (one all-gather per unit and microbatch at pp = 1,
    fewer with pipeline schedules, at the memory of the stage's gathered parameters)."""
    overlap_param_gather: bool = opt(
        False,
        "--overlap-param-gather",
        "with --use-distributed-optimizer: overlap the parameter all-gather with the next forward",
        "dp",
    )
    """Distributed optimizer: all-gather updated parameters asynchronously; each module's forward
    waits only for the buckets holding its own parameters."""
    bind_cpus: Literal["none", "numa", "exclusive"] = opt(
        "none",
        "--bind-cpus",
        "bind each worker to CPUs at start-up: numa = its GPU's NUMA node, exclusive = a non-overlapping share of it",
        "layout",
    )
    """CPU binding of each worker at start-up: none (leave the affinity alone), numa (the allowed
    CPUs of its GPU's NUMA node; without GPUs, of the node it is spread to) or exclusive (a
    non-overlapping share of them); see :mod:`ptdp.topology.binding`."""

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def sharding_strategy(self) -> str:
        """The data-parallel sharding strategy: the explicit one, else ``optim`` with
        ``use_distributed_optimizer``, else ``no_shard``."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def interleaved(self) -> bool:
        """Model chunks are asked for: layers per chunk, or v > 1."""
        v = self.virtual_pipeline_model_parallel_size
        return bool(self.num_layers_per_virtual_pipeline_stage) or (isinstance(v, int) and v > 1)

    @property
    def schedule(self) -> PipelineSchedule:
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved-1f1b" if self.interleaved else "1f1b"

    def pipeline_split(self, num_layers: int) -> PipelineSplit:
        """Where the layers of a ``num_layers`` model sit as the options ask (v chunks per rank;
        ``pipeline_layer_split``, the first/last counts expanded, or the split with the embedding /
        loss counted as layers); raises ``ConfigError`` when they are impossible."""
        return pipeline_split(
            num_layers,
            self.pp,
            self.pipeline_layer_split,
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
            embedding=self.account_for_embedding_in_pipeline_split,
            loss=self.account_for_loss_in_pipeline_split,
            layers_per_chunk=self.num_layers_per_virtual_pipeline_stage,
            v=self.virtual_pipeline_model_parallel_size or (2 if self.schedule in V_SCHEDULES else None),
            placement=placement_of(self.schedule),
        )

    @property
    def accounted_units(self) -> int:
        """Units counted besides the layers when splitting: the embedding and/or the loss (0-2)."""
        return int(self.account_for_embedding_in_pipeline_split) + int(self.account_for_loss_in_pipeline_split)

    @property
    def dp(self) -> int:
        if self.data_parallel_size is None:
            from ptdp.errors import ConfigError

            raise ConfigError("data_parallel_size is not resolved yet; call ptdp.config.resolve")
        return self.data_parallel_size

    @property
    def codec(self) -> CodecChoice:
        """The data-parallel gradient codec and its exact warmup."""
        return CodecChoice(self.grad_compression, self.grad_compression_warmup_iters)
