"""Step-time model: compute, recompute, communication, pipeline bubble and optimizer of one step.

Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473 (§2.2 bubble, §3.2 communication, eq. 3
FLOPs); [K22] Korthikanti et al., arXiv:2205.05198 (§5 selective recompute, §6 model FLOPs).

The time of one microbatch on a pipeline stage is the sum of its layers' compute
(:func:`ptdp.planner.flops.layer_compute_times`), the recompute forward, the exposed TP
communication (:mod:`ptdp.planner.comm`; Megatron-style TP does not overlap it) and, with
pp > 1, two stage-to-stage transfers per model chunk. A 1F1B or GPipe step is
``m`` slots of the busiest stage plus ``(pp - 1) / v`` slots of a layers-only stage of fill and
drain ([N21] §2.2: bubble fraction ``(pp - 1) / (v m)``), then the data-parallel gradient
reduction (minus the part hidden behind backward) and the optimizer update, which is bound by
memory bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ptdp.planner import flops
from ptdp.planner.comm import (
    Links,
    embedding_sync_time,
    hierarchical_all_reduce_time,
    pp_transfer_time,
    tp_layer_comm_times,
)
from ptdp.planner.context import block_attention_times, kv_exchange_times, layer_times, local_model
from ptdp.planner.hardware import Cluster
from ptdp.planner.memory import _even_stage_params, layer_param_count, stage_param_counts
from ptdp.planner.models import ModelSpec
from ptdp.planner.plan import Layout, TimeBreakdown
from ptdp.planner.sharding import chunk_by_chunk, optimizer_bytes_per_param, sharded_dp_times
from ptdp.spec import padded_vocab_size


@dataclass(frozen=True)
class PerfConstants:
    """Every tunable constant of the time model, with its physical meaning.

    Two are fitted, jointly, by least squares of ln(predicted / reported) over the 18 published
    runs of ``published_runs.csv`` (Megatron SC21 Table 1 TFLOP/s and Korthikanti et al. 2022
    Table 5 iteration times, all on A100-80GB; ``python -m ptdp.planner.validate --fit``, results
    in BENCHMARKS.md), never per run. The others are set from physics or defaults of the software.
    Where the physics of a GPU generation differs, ``arch_fits`` holds that generation's own
    values of the GEMM and HBM efficiencies (:meth:`for_gpu`), fitted the same way on its
    published runs (Hopper: ``published_runs_h100.csv``).

    Attributes:
        gemm_peak_fraction: fraction of the tensor-core peak a large, well-shaped 16-bit GEMM
            reaches inside a training step (cuBLAS kernels, clock under sustained load).
            Fitted.
        gemm_half_dim: GEMM dimension at which tile/wave quantisation halves the speed
            (:func:`ptdp.planner.flops.gemm_efficiency`); 64 = half a 128-wide tensor-core tile.
            Set, not fitted (also the least-squares optimum over 16-128).
        hbm_efficiency: achieved fraction of the datasheet HBM bandwidth by memory-bound kernels
            (elementwise, softmax, optimizer). Fitted.
        nvlink_efficiency: achieved NCCL bus bandwidth inside a node / NVLink bandwidth per
            direction (about 240 of 300 GB/s on A100). Set, not fitted; with the fitted two
            fixed it is also the least-squares optimum over 0.6-1.0.
        network_efficiency: achieved bandwidth of inter-node transfers / NIC line rate per GPU.
            Set, not fitted (0.9: InfiniBand HDR/NDR payload efficiency; the published runs
            barely depend on it).
        nvlink_latency, network_latency: seconds per ring step of a collective (launch + link
            latency). Set, not fitted (the published runs' messages are large).
        dp_overlap: fraction of the end-of-step data-parallel reduction hidden behind compute.
            0 (the default): all of it exposed, as in the Megatron versions of the A100 runs.
            :func:`ptdp.planner.validate.run_constants` sets it for each published run that
            overlapped (the share of the reduction one microbatch's compute can hide). ptdp's own
            ``--overlap-grad-reduce`` (on by default) starts buckets during the last microbatch's
            backward; ``ptdp plan`` does not credit that yet, so its DP time is an upper bound.
        overlap_window: the end-of-step data-parallel reduction starts bucket by bucket during the
            last microbatch's backward and the weights' all-gather runs during the next step's
            first forward (Megatron's ``--overlap-grad-reduce --overlap-param-gather``, ptdp's
            ``--overlap-grad-reduce``): it is hidden up to one microbatch's compute on the busiest
            stage, the window in which those gradients exist and nothing waits for them. False:
            only ``dp_overlap`` hides it.
        pp_scatter_gather: pipeline messages split over the tp ranks and all-gathered on NVLink
            ([N21] §4.1), as in the published runs.
        layer_overhead: host seconds per transformer layer per microbatch (forward + backward)
            that the device does not hide: operator dispatch, autograd, Python. 0 on GPUs (kernel
            launches run ahead of the device at these sizes); fitted by ``ptdp plan --calibrate``
            on a CPU as the measured time of one real layer minus the predicted one.
        head_overhead: the same for the output layer and loss of the last stage.
        optimizer_efficiency: achieved fraction of the memory-bound bandwidth by the optimizer
            step (Adam update, gradient norm, zeroing). 1 on GPUs (fused multi-tensor kernels);
            measured by ``ptdp plan --calibrate`` on a CPU, where per-tensor overhead shows.
        tp_overlap: fraction of the layers' tensor-parallel communication hidden behind the GEMMs
            it feeds (the embedding's and the logits' all-reduce stay exposed). 0: ptdp and the Megatron versions of the A100 runs wait for each collective.
            Transformer Engine's comm-GEMM overlap (Megatron's ``--tp-comm-overlap``) splits each
            GEMM into tp chunks and exchanges one chunk while multiplying another, so all but the
            first of tp transfers are hidden: ``(tp - 1) / tp`` for the runs that used it
            (:func:`ptdp.planner.validate.run_constants`).
        arch_fits: per GPU architecture (:attr:`ptdp.planner.hardware.GPUSpec.arch`), that
            generation's ``(arch, gemm_peak_fraction, gemm_half_dim, hbm_efficiency)``. Hopper
            (H100, H200): 0.61 and 0.65 fitted jointly by least squares over the 13 published H100
            runs without context parallelism (``python -m ptdp.planner.validate
            benchmarks/data/published_runs_h100.csv --fit``), ``gemm_half_dim`` 128 set: Hopper's
            tensor-core GEMMs run 128 x 256 tiles (warp-group MMAs of 64 x N), half of a 256-wide
            tile, twice Ampere's. 0.61 x 989.5 = 604 TFLOP/s for a large bf16 GEMM in a training
            step; the datasheet's peak is 528 tensor cores x 1,024 FLOP per clock at 1.83 GHz, and
            what a step gets below it is the clock a 700 W card holds under load times the
            kernels' efficiency, which the fit does not separate.
    """

    gemm_peak_fraction: float = 0.77
    gemm_half_dim: float = 64.0
    hbm_efficiency: float = 0.80
    nvlink_efficiency: float = 0.80
    network_efficiency: float = 0.90
    nvlink_latency: float = 5e-6
    network_latency: float = 10e-6
    dp_overlap: float = 0.0
    pp_scatter_gather: bool = True
    layer_overhead: float = 0.0
    head_overhead: float = 0.0
    optimizer_efficiency: float = 1.0
    tp_overlap: float = 0.0
    overlap_window: bool = False
    arch_fits: tuple[tuple[str, float, float, float], ...] = (("hopper", 0.61, 128.0, 0.65),)

    def __post_init__(self) -> None:  # a profile read from JSON holds lists
        object.__setattr__(self, "arch_fits", tuple(tuple(fit) for fit in self.arch_fits))

    def for_gpu(self, gpu) -> PerfConstants:
        """These constants with ``gpu.arch``'s fitted efficiencies (``arch_fits``), or unchanged
        for an architecture without its own fit (Ampere, whose fit the plain fields hold; a
        calibrated CPU)."""
        return _for_arch(self, getattr(gpu, "arch", ""))


@lru_cache(maxsize=256)
def _for_arch(constants: PerfConstants, arch: str) -> PerfConstants:
    for name, gemm, half_dim, hbm in constants.arch_fits:
        if name == arch:
            return dataclasses.replace(
                constants, gemm_peak_fraction=gemm, gemm_half_dim=half_dim, hbm_efficiency=hbm, arch_fits=()
            )
    return constants


DEFAULT_CONSTANTS = PerfConstants()

Parts = tuple[float, ...]
"""Per-microbatch seconds of a stage by part: (compute, recompute, tp_comm, cp_comm)."""

#: Bytes per parameter the optimizer step reads and writes (mixed precision, fp32 main weights):
#: on every parameter: write the 16-bit weight (2), read the gradient for the global norm (4),
#: zero the gradient buffer (4); on the parameters this rank updates (1/dp of them with the
#: distributed optimizer): read the gradient (4), read and write the main weight, m and v (24).
OPT_BYTES_FULL = {"bf16": 10.0, "fp16": 10.0, "fp32": 8.0, "fp8": 10.0}
OPT_BYTES_SHARDED = {"bf16": 28.0, "fp16": 28.0, "fp32": 28.0, "fp8": 28.0}


@dataclass(frozen=True)
class Performance:
    """Predicted speed of one layout.

    Attributes:
        time: seconds of one step by part; ``time.step`` is the step time.
        tflops_per_gpu: executed FLOP/s per GPU, in FLOP/s like every rate of this module
            (divide by 1e12 for the TFLOP/s the papers print; a :class:`~ptdp.planner.plan.Plan`
            holds it in TFLOP/s), counted like [N21]: eq. 3 with full
            recompute (the recompute forward included); with selective recompute the model
            FLOPs plus the attention core once more; without recompute the model FLOPs.
        mfu: model FLOPs utilisation, ``model FLOPs / (step time * GPUs * peak)`` [K22] §6.
        model_flops: FLOPs of one step without recompute, all GPUs.
        hardware_flops: FLOPs executed in one step, all GPUs (recompute included).
        tokens_per_second: ``B s / step``.
    """

    time: TimeBreakdown
    tflops_per_gpu: float
    mfu: float
    model_flops: float
    hardware_flops: float
    tokens_per_second: float

    @property
    def step_time(self) -> float:
        return self.time.step


def core_shared_step(busy: list[float], pp: int, workers: int, cores: int) -> float:
    """Step time when ``workers`` processes share ``cores`` CPU cores: the node's total busy time
    over its cores (processor sharing: a worker that waits gives its core to the others).

    ``busy``: seconds one worker of the (first, middle, last) stage computes and communicates per
    step when running alone on a core (with pp = 1 the last stage's figure covers the whole
    model). The node's workers are spread evenly over the ``pp`` stages.
    """
    first, mid, last = busy
    per_stage = [last] if pp == 1 else [first] + [mid] * (pp - 2) + [last]
    return workers * (sum(per_stage) / pp) / cores


def links_for(cluster: Cluster, constants: PerfConstants) -> Links:
    """Achieved link bandwidths of ``cluster``'s GPU under ``constants``."""
    gpu = cluster.gpu
    return Links(
        gpu.nvlink_bandwidth * constants.nvlink_efficiency
        if gpu.nvlink_bandwidth
        else gpu.network_bandwidth * constants.network_efficiency,
        gpu.network_bandwidth * constants.network_efficiency,
        constants.nvlink_latency,
        constants.network_latency,
        cluster.gpus_per_node,
    )


def rank_layer_times(
    model: ModelSpec, layout: Layout, peak: float, bandwidth: float, c: PerfConstants, fp8_peak: float = 0.0
) -> tuple[float, float, float, float, float]:
    """(forward, backward, attention core, one block's forward attention, its backward) seconds
    of one layer on one tp and cp rank for one microbatch (:mod:`ptdp.planner.context`: the
    ``s / cp``-token layer attending ``cp`` blocks; the last two hide one ring step of the
    key/value exchange each)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    times = flops.layer_compute_times(
        local,
        layout.tp,
        layout.micro_batch_size,
        layout.sequence_parallel,
        peak,
        bandwidth,
        c.gemm_peak_fraction,
        c.gemm_half_dim,
        fp8_peak,
    )
    if layout.cp == 1:
        return (*times, times[2], 2.0 * times[2])
    block = block_attention_times(
        local,
        layout.tp,
        layout.micro_batch_size,
        times[2],
        peak_flops=peak,
        peak_fraction=c.gemm_peak_fraction,
        half_dim=c.gemm_half_dim,
    )
    return (*layer_times(times, block, layout.cp), *block)


def _stage_microbatch_times(
    model: ModelSpec,
    layout: Layout,
    peak: float,
    bandwidth: float,
    links: Links,
    c: PerfConstants,
    v_pad: int,
    elem: float,
    layers: int,
    fp8_peak: float = 0.0,
) -> tuple[Parts, Parts, Parts]:
    """(compute, recompute, tp_comm, cp_comm) seconds of one microbatch on (middle, first, last)
    stages of one cp rank (:func:`rank_layer_times`; tp transfers and logits of ``s / cp`` tokens,
    key/value exchange :func:`ptdp.planner.context.kv_exchange_times`, again in a full recompute);
    ``fp8_peak`` > 0: the layers' weight GEMMs run at that FP8 peak (FLOP/s)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    tp, b, s, h = layout.tp, layout.micro_batch_size, local.seq_length, model.hidden_size
    fwd, bwd, core, block, block_bwd = rank_layer_times(model, layout, peak, bandwidth, c, fp8_peak)
    tp_f, tp_b = tp_layer_comm_times(
        b * s, h, tp, sequence_parallel=layout.sequence_parallel, links=links, bytes_per_element=elem
    )
    tp_f, tp_b = (1.0 - c.tp_overlap) * tp_f, (1.0 - c.tp_overlap) * tp_b
    cp_f, cp_b = kv_exchange_times(model, tp, layout.cp, b, layout.cp_comm_type, block, links, elem, block_bwd)
    rec = {"full": fwd, "selective": core}.get(layout.recompute, 0.0)
    full = layout.recompute == "full"
    rec_comm, rec_cp = (tp_f, cp_f) if full else (0.0, 0.0)
    mid = (
        layers * (fwd + bwd + c.layer_overhead),
        layers * rec,
        layers * (tp_f + tp_b + rec_comm),
        layers * (cp_f + cp_b + rec_cp),
    )
    one_ar = hierarchical_all_reduce_time(elem * b * s * h, tp, links.gpus_per_node, links)
    logits = flops.logits_compute_time(local, tp, b, v_pad, peak, bandwidth, c.gemm_peak_fraction, c.gemm_half_dim)
    first = (mid[0], mid[1], mid[2] + one_ar, mid[3])
    last = (mid[0] + logits + c.head_overhead, mid[1], mid[2] + one_ar, mid[3])
    if layout.pp == 1:
        last = (last[0], last[1], last[2] + one_ar, last[3])
    return mid, first, last


def split_stage_times(
    split: tuple[int, ...], layer: tuple[float, ...], first: tuple[float, ...], last: tuple[float, ...]
) -> tuple[Parts, Parts, Parts, Parts, float]:
    """Per-microbatch times of the stages of an uneven split, from ``layer`` (the times of one
    layer) and ``first`` / ``last`` (one layer plus the first / last stage's edge work), each a
    tuple of parts (compute, recompute, tp_comm).

    Returns (first stage, mean of the middle stages, last stage, busiest stage, fill seconds): stage
    i takes ``split[i]`` layers plus its edge; the busiest has the largest total (the later on a tie);
    fill and drain take the layers-only time of all the other stages, ``(sum(split) -
    split[busiest]) * sum(layer)`` (the 1F1B step of stages with times t_i is about
    ``m max t_i + sum of the others``, [N21] §2.2 generalised; with an even split it is the
    ``(pp - 1)`` layers-only slots of :func:`evaluate_performance`). Needs ``len(split) >= 2``.
    """
    edge_first = [f - u for f, u in zip(first, layer)]
    edge_last = [x - u for x, u in zip(last, layer)]
    stages = [tuple(n * u for u in layer) for n in split]
    stages[0] = tuple(t + e for t, e in zip(stages[0], edge_first))
    stages[-1] = tuple(t + e for t, e in zip(stages[-1], edge_last))
    busiest = max(range(len(split)), key=lambda i: (sum(stages[i]), i))
    middle = stages[1:-1] or [tuple(0.0 for _ in layer)]
    mean = tuple(sum(col) / len(middle) for col in zip(*middle))
    fill = (sum(split) - split[busiest]) * sum(layer)
    return stages[0], mean, stages[-1], stages[busiest], fill


def edge_layer_equivalents(
    model: ModelSpec,
    layout: Layout,
    cluster: Cluster,
    constants: PerfConstants = DEFAULT_CONSTANTS,
    *,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[float, float]:
    """(first, last): the first stage's embedding work and the last stage's output layer + loss, in
    transformer layers of this time model (one microbatch; compute, recompute and exposed tp
    communication). Their FLOPs: the lookup has none, the output layer ``2 b s h V / t`` forward, a
    layer about ``(24 h^2 + 4 h s) b s / t`` for GPT ([N21] eq. 3's terms), so the loss side is about
    ``V / (12 h + 2 s)`` layers; the time model adds the memory-bound and communication parts."""
    c, gpu, prec = constants.for_gpu(cluster.gpu), cluster.gpu, layout.precision
    peak = gpu.peak("bf16" if prec == "fp8" else prec)
    fp8_peak = gpu.peak("fp8") if prec == "fp8" else 0.0
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, layout.tp)
    elem = 4.0 if prec == "fp32" else 2.0
    layer, first, last = _stage_microbatch_times(
        model, layout, peak, gpu.memory_bandwidth * c.hbm_efficiency, links_for(cluster, c), c, v_pad, elem, 1, fp8_peak
    )
    unit = sum(layer)
    return (sum(first) - unit) / unit, (sum(last) - unit) / unit


def _dp_comm_time(
    model: ModelSpec,
    layout: Layout,
    n_params: int,
    busiest: tuple[float, ...],
    stage_layers: int,
    elem: float,
    links: Links,
    c: PerfConstants,
    layer: tuple[float, ...],
) -> float:
    """Exposed seconds of the data-parallel communication of the stage's ``n_params`` parameters
    over ``dp * cp`` ranks under the layout's sharding strategy
    (:func:`ptdp.planner.sharding.sharded_dp_times`): float32 gradients, ``elem``-byte weights,
    units of one layer (plus the embedding / output unit), hidden behind one microbatch's
    backward (the busiest stage's compute without its forward third) and one layer's compute;
    chunk by chunk (:func:`~ptdp.planner.sharding.chunk_by_chunk`) each chunk's behind the next
    chunk's backward round.
    With ``c.overlap_window`` the end-of-step part left by ``c.dp_overlap`` is hidden up to one
    microbatch's compute on the busiest stage (``busiest[0]``)."""
    per_layer = layer_param_count(model, layout.tp)
    unit = max(per_layer, n_params - stage_layers * per_layer)
    microbatch_backward = busiest[0] * 2.0 / 3.0
    v = layout.virtual_stages
    chunks = (
        v if chunk_by_chunk(layout.sharding_strategy, layout.shard_size, v, layout.num_microbatches, layout.pp) else 1
    )

    def exposed(end_overlap: float) -> float:
        return sharded_dp_times(
            layout.sharding_strategy,
            grad_bytes=4.0 * n_params,
            param_bytes=elem * n_params,
            unit_param_bytes=elem * unit,
            tp=layout.tp,
            shard=layout.shard_size,
            num_microbatches=layout.num_microbatches,
            units=stage_layers + 1,
            layer_forward=layer[0],
            layer_backward=layer[1],
            microbatch_backward=microbatch_backward,
            links=links,
            end_overlap=end_overlap,
            chunks=chunks,
        )

    if not c.overlap_window:
        return exposed(c.dp_overlap)
    without_end = exposed(1.0)
    return without_end + max(0.0, exposed(c.dp_overlap) - without_end - busiest[0])


def evaluate_performance(
    model: ModelSpec,
    layout: Layout,
    cluster: Cluster,
    constants: PerfConstants = DEFAULT_CONSTANTS,
    *,
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
) -> Performance:
    """Predicted step time, TFLOP/s per GPU and MFU of ``layout`` (1F1B, or interleaved 1F1B when
    ``layout.virtual_stages > 1``; GPipe has the same time) on ``cluster``.

    Step = m x (busiest stage's microbatch: compute + recompute + TP + 2 v PP transfers)
    + (pp - 1)/v x (a layers-only stage's microbatch) + exposed DP + optimizer.
    The DP reduction moves fp32 gradients (ptdp's main-grad buffer, 4 bytes per parameter; with
    the distributed optimizer, reduce-scatter of those + all-gather of the 16-bit weights).
    ``layer_split`` (layers per stage; default ``layout.layer_split``, None: even): each stage's
    microbatch is its layers plus its edge work (the first stage's embedding, the last stage's output
    layer + loss), the busiest stage sets the m slots, and fill and drain take the layers-only time
    of every other stage, ``(l - l_busiest)`` layers plus ``pp - 1`` transfers (:func:`split_stage_times`;
    with an even split this is the ``(pp - 1)`` slots above).
    Cost: O(1) in pp; per-model and per-(tp, b, sp) quantities are cached.
    """
    c, gpu, prec = constants.for_gpu(cluster.gpu), cluster.gpu, layout.precision
    peak = gpu.peak("bf16" if prec == "fp8" else prec)  # fp8: attention, logits and MFU at the bf16 peak
    fp8_peak = gpu.peak("fp8") if prec == "fp8" else 0.0
    bandwidth = gpu.memory_bandwidth * c.hbm_efficiency
    links = links_for(cluster, c)
    elem = 4.0 if prec == "fp32" else 2.0
    tp, pp, v, m = layout.tp, layout.pp, layout.virtual_stages, layout.num_microbatches
    layer_split = layer_split if layer_split is not None else layout.layer_split
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, tp)
    split = layer_split if layer_split is not None and len(layer_split) > 1 else None  # None: an even split
    if split is None:
        first_params, last_params, _ = _even_stage_params(model, tp, pp, make_vocab_size_divisible_by)
        n_params, layers = max(first_params, last_params), model.num_layers // pp
        stage_layers = layers
    else:
        n_params = max(
            stage_param_counts(
                model, tp, pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by, layer_split=split
            )
        )
        layers = 1  # one layer and the edges: each stage's time is built from them
        stage_layers = max(split)
    mid, first, last = _stage_microbatch_times(model, layout, peak, bandwidth, links, c, v_pad, elem, layers, fp8_peak)
    busiest = last if sum(last) >= sum(first) else first
    p2p = (
        2.0
        * v
        * pp_transfer_time(
            layout.micro_batch_size * model.seq_length // layout.cp,
            model.hidden_size,
            tp,
            layout.shard_size,
            pp,
            sequence_parallel=layout.sequence_parallel,
            links=links,
            bytes_per_element=elem,
            scatter_gather=c.pp_scatter_gather,
        )
    )
    bubble = (pp - 1) / v * (sum(mid) + p2p)
    if split is not None:
        first, mid, last, busiest, fill = split_stage_times(split, mid, first, last)
        bubble = (fill + (pp - 1) * p2p) / v  # interleaving spreads fill and drain over v chunks ([N21] §2.2)

    exposed_dp = _dp_comm_time(
        model,
        layout,
        n_params,
        busiest,
        stage_layers,
        elem,
        links,
        c,
        rank_layer_times(model, layout, peak, bandwidth, c, fp8_peak),
    )
    if model.tied and pp > 1:
        exposed_dp += (1.0 - c.dp_overlap) * embedding_sync_time(
            4.0 * v_pad // tp * model.hidden_size, pp, tp, layout.shard_size, links
        )
    shard = layout.shard_size
    per_param = optimizer_bytes_per_param(
        OPT_BYTES_FULL[prec], OPT_BYTES_SHARDED[prec], layout.sharding_strategy, shard, weight_bytes=elem
    )
    optimizer = n_params * per_param / (bandwidth * c.optimizer_efficiency)

    time = TimeBreakdown(
        compute=m * busiest[0],
        recompute=m * busiest[1],
        tp_comm=m * busiest[2],
        pp_comm=m * p2p,
        bubble=bubble,
        dp_comm=exposed_dp,
        optimizer=optimizer,
        cp_comm=m * busiest[3],
    )
    if gpu.shared_cores and cluster.gpus_per_node > gpu.shared_cores:
        per_step = exposed_dp + optimizer
        busy = [m * (sum(stage) + p2p) + per_step for stage in (first, mid, last)]
        time = dataclasses.replace(
            time, core_sharing=max(0.0, core_shared_step(busy, pp, cluster.gpus_per_node, gpu.shared_cores) - time.step)
        )
    step = time.step
    gpus = layout.num_gpus
    model_flops = flops.model_flops_per_step(model, layout.global_batch_size)
    hw_flops = flops.hardware_flops_per_step(model, layout.global_batch_size, layout.recompute)
    return Performance(
        time=time,
        tflops_per_gpu=hw_flops / (step * gpus),
        mfu=model_flops / (step * gpus * peak),
        model_flops=model_flops,
        hardware_flops=hw_flops,
        tokens_per_second=layout.global_batch_size * model.seq_length / step,
    )
