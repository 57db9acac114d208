"""Step-time model: compute, recompute, communication, pipeline bubble and optimizer of one step.

Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473 (§2.2 bubble, §3.2 communication, eq. 3
FLOPs); [K22] Korthikanti et al., arXiv:2205.05198 (§5 selective recompute, §6 model FLOPs).

A 1F1B or GPipe step is ``m`` microbatch slots of the busiest stage plus ``(pp - 1) / v`` slots of a
layers-only stage of fill and drain ([N21] §2.2: bubble fraction ``(pp - 1) / (v m)``), then the
exposed data-parallel reduction and the memory-bound optimizer update. A schedule running B and W
apart (zb-h1, zb-h2, zb-v, dualpipev) has the bubble of its own program timed with the stage's F,
B and W (:mod:`ptdp.planner.time.pipeline_bubble`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ptdp.config.model import ModelConfig
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.timing import StageTimes
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import Candidate, TimeBreakdown
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.inputs.moe_model import MoEModel, moe_of
from ptdp.planner.memory.moe_params import layout_stage_counts
from ptdp.planner.memory.params import even_stage_params, stage_param_counts
from ptdp.planner.time import flops
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants, links_for
from ptdp.planner.time.data_parallel import (
    dp_comm_time,
    edp_comm_time,
    embedding_sync_dp_time,
    expert_optimizer_time,
    optimizer_time,
)
from ptdp.planner.time.pipeline_bubble import bubble_floor, splits_backward, step_bubble
from ptdp.planner.time.stages import (
    Parts,
    fp8_gemms,
    layer_passes,
    pipeline_transfer_time,
    rank_layer_times,
    split_stage_times,
    stage_microbatch_times,
)

__all__ = ["Performance", "core_shared_step", "evaluate_performance"]


@dataclass(frozen=True)
class Performance:
    """Predicted speed of one layout.

    Attributes:
        time: seconds of one step by part; ``time.step`` is the step time.
        tflops_per_gpu: executed FLOP/s per GPU (not TFLOP/s, despite the name), counted like [N21]
            eq. 3: recompute forward included, selective recompute adds the attention core.
        mfu: model FLOPs utilisation, ``model FLOPs / (step time * GPUs * peak)`` [K22] §6.
        model_flops: FLOPs of one step without recompute, all GPUs.
        hardware_flops: FLOPs executed in one step, all GPUs (recompute included).
        tokens_per_second: ``B s / step``.
        passes: F, B, W and p2p seconds of one microbatch on a middle pipeline rank
            (:func:`pass_times`); None without a pipeline.
    """

    time: TimeBreakdown
    tflops_per_gpu: float
    mfu: float
    model_flops: float
    hardware_flops: float
    tokens_per_second: float
    passes: StageTimes | None = None

    @property
    def step_time(self) -> float:
        return self.time.step


def exposed_p2p(p2p: float, busiest: Parts, v: int, c: PerfConstants) -> float:
    """Exposed seconds of one microbatch's ``p2p`` seconds of stage-to-stage transfers on the
    busiest stage: all of them, or with ``c.pp_overlap`` and the interleaved schedule (``v > 1``)
    only their excess over the microbatch's work on that stage (``busiest``: compute, recompute,
    tp and cp communication), each transfer running while another model chunk computes
    (:attr:`PerfConstants.pp_overlap`; the fill and drain transfers are in the bubble)."""
    if c.pp_overlap and v > 1:
        return max(0.0, p2p - sum(busiest))
    return p2p


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


def _stage_extent(
    model: ModelConfig, layout: Candidate, split: tuple[int, ...] | None, divisible_by: int
) -> tuple[tuple[int, ...], int, int, int]:
    """(parameters on one tp rank of the first stage and of the other stage holding the most,
    layers the per-microbatch times are built from, layers of the stage with the most, routed
    experts in their own buffer on the stage holding the most): an even split's stages hold
    ``l / pp`` layers each; an uneven ``split``'s times are built from one layer and the edges
    (:func:`ptdp.planner.time.stages.split_stage_times`)."""
    if isinstance(model, MoEModel):
        dense, own = layout_stage_counts(model, layout, split, divisible_by)
        layers = model.num_layers // layout.pp if split is None else 1
        most = model.num_layers // layout.pp if split is None else max(split)
        return (dense[0], max(dense[1:], default=dense[0]))[: min(layout.pp, 2)], layers, most, max(own)
    placement = placement_of(layout.parallel.schedule)
    if split is None:
        first_params, last_params, _ = even_stage_params(model, layout.tp, layout.pp, divisible_by, placement)
        layers = model.num_layers // layout.pp
        return (first_params, last_params)[: min(layout.pp, 2)], layers, layers, 0
    counts = stage_param_counts(
        model, layout.tp, layout.pp, make_vocab_size_divisible_by=divisible_by, layer_split=split, placement=placement
    )
    return (counts[0], max(counts[1:])), 1, max(split), 0


def _with_core_sharing(
    time: TimeBreakdown, stages: tuple[Parts, ...], p2p: float, m: int, layout: Candidate, cluster: Cluster
) -> TimeBreakdown:
    """``time`` with the wait of workers sharing CPU cores (:func:`core_shared_step`) when the
    cluster's device runs more workers per node than it has cores; unchanged otherwise.
    ``stages``: the (first, middle, last) stages' per-microbatch parts."""
    gpu = cluster.gpu
    if not (gpu.shared_cores and cluster.gpus_per_node > gpu.shared_cores):
        return time
    per_step = time.dp_comm + time.optimizer
    busy = [m * (sum(stage) + p2p) + per_step for stage in stages]
    shared = core_shared_step(busy, layout.pp, cluster.gpus_per_node, gpu.shared_cores)
    return dataclasses.replace(time, core_sharing=max(0.0, shared - time.step))


def pass_times(model: ModelConfig, layout: Candidate, rates: tuple, layers: float, p2p: float) -> StageTimes:
    """F, B and W seconds of one microbatch on a pipeline rank of ``layers`` layers, all its chunks
    together, when the backward is split (:func:`~ptdp.planner.time.stages.layer_passes`; W at
    ``c.wgrad_efficiency`` of the GEMM efficiency), and one transfer ``p2p / (2 v)`` between ranks:
    what ``ptdp schedule`` times a schedule with, ``auto`` included."""
    peak, bandwidth, links, c, elem, fp8 = rates
    forward, backward_input, wgrad = layer_passes(model, layout, peak, bandwidth, links, c, elem, fp8)
    return StageTimes(
        forward=layers * forward,
        backward_input=layers * backward_input,
        backward_weight=layers * wgrad / c.wgrad_efficiency,
        p2p=p2p / (2 * layout.virtual_stages),
    )


def evaluate_performance(
    model: ModelConfig,
    layout: Candidate,
    cluster: Cluster,
    constants: PerfConstants = DEFAULT_CONSTANTS,
    *,
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
    simulate_bubble: bool = True,
) -> Performance:
    """Predicted step time, TFLOP/s per GPU and MFU of ``layout`` (1F1B, or interleaved 1F1B when
    ``layout.virtual_stages > 1``; GPipe has the same time; the schedule its parallel config names
    when it runs B and W apart) on ``cluster``.

    Step = m x (busiest stage's microbatch: compute + recompute + TP + exposed PP transfers)
    + (pp - 1)/v x (a layers-only stage's microbatch) + exposed DP (fp32 gradients) + optimizer.
    B and W apart: the bubble of its program timed with :func:`pass_times`, a slower W's extra in the compute,
    the DP reduction hidden only up to ``c.dp_overlap`` (``ptdp train`` overlaps it with the W
    completing each chunk's gradients, shorter than the backward the window assumes); on the V placement
    rank 0 runs the first and the last stage's edge work.
    ``layer_split`` (default ``layout.layer_split``, None: even): each stage runs its layers plus its edge
    work and fill and drain take the other stages' layers (:func:`split_stage_times`).
    ``simulate_bubble`` False: a schedule running B and W apart gets :func:`~ptdp.planner.time.pipeline_bubble.bubble_floor`
    for its bubble (its program not simulated), a lower bound of its step time.
    """
    c, gpu, prec = constants.for_gpu(cluster.gpu), cluster.gpu, layout.precision
    # fp8: attention, logits and MFU at the bf16 peak; the kernels at the power limit's, MFU at the datasheet's
    peak = gpu.sustained_peak("bf16" if prec == "fp8" else prec)
    fp8 = fp8_gemms(layout, gpu, c)
    bandwidth = gpu.memory_bandwidth * c.hbm_efficiency
    links = links_for(cluster, c)
    elem = 4.0 if prec == "fp32" else 2.0
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_microbatches
    layer_split = layer_split if layer_split is not None else layout.layer_split
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, layout.tp)
    split = layer_split if layer_split is not None and len(layer_split) > 1 else None  # None: an even split
    stage_params, layers, stage_layers, expert_params = _stage_extent(
        model, layout, split, make_vocab_size_divisible_by
    )
    n_params = max(stage_params)
    mid, first, last = stage_microbatch_times(model, layout, peak, bandwidth, links, c, v_pad, elem, layers, fp8)
    kind = layout.parallel.schedule
    if placement_of(kind) == "v":  # rank 0 runs the first and the last stage
        first, last = tuple(f + x - u for f, x, u in zip(first, last, mid)), mid
    busiest = last if sum(last) >= sum(first) else first
    p2p = pipeline_transfer_time(model, layout, links, elem, c)
    bubble = (pp - 1) / v * (sum(mid) + p2p)
    fill, unit = None, sum(mid) / layers  # a layer's microbatch
    if split is not None:
        first, mid, last, busiest, fill = split_stage_times(split, mid, first, last)
        bubble = (fill + (pp - 1) * p2p) / v  # interleaving spreads fill and drain over v chunks ([N21] §2.2)
    passes = None
    if pp > 1:
        # ranks of the middle stage's layers, or with an uneven split the other stages' mean
        rank_layers = layers if fill is None else fill / ((pp - 1) * unit)
        one = pass_times(model, layout, (peak, bandwidth, links, c, elem, fp8), 1, p2p)
        passes = dataclasses.replace(
            one, **{k: rank_layers * getattr(one, k) for k in ("forward", "backward_input", "backward_weight")}
        )
    if splits_backward(kind) and passes is not None:
        bubble = step_bubble(kind, pp, m, v, passes) if simulate_bubble else bubble_floor(pp, v, passes)
        wgrad_extra = one.backward_weight * (1 - c.wgrad_efficiency)  # a slower W's, per layer
        busiest = (busiest[0] + stage_layers * wgrad_extra, *busiest[1:])
        c = dataclasses.replace(c, overlap_window=False)  # ptdp train's reductions overlap the last W only
    layer = rank_layer_times(model, layout, peak, bandwidth, c, fp8)
    # the first stage's, which gathers its embeddings for forward only, or another's
    exposed_dp = max(
        dp_comm_time(model, layout, n, busiest, stage_layers, elem, links, c, layer, first_stage=rank == 0)
        for rank, n in enumerate(stage_params)
    )
    exposed_dp += embedding_sync_dp_time(model, layout, v_pad, links, c)
    time = TimeBreakdown(
        compute=m * busiest[0],
        recompute=m * busiest[1],
        tp_comm=m * busiest[2],
        pp_comm=m * exposed_p2p(p2p, busiest, v if kind == "interleaved-1f1b" else 1, c),
        bubble=bubble,
        dp_comm=exposed_dp,
        optimizer=optimizer_time(n_params, layout, elem, bandwidth, c)
        + expert_optimizer_time(expert_params, layout, elem, bandwidth, c),
        cp_comm=m * busiest[3],
        ep_comm=m * busiest[4],
        edp_comm=edp_comm_time(layout, expert_params, links, c, busiest[0]),
    )
    time = _with_core_sharing(time, (first, mid, last), p2p, m, layout, cluster)
    step, gpus = time.step, layout.num_gpus
    model_flops = flops.model_flops_per_step(model, layout.global_batch_size, moe_of(model))
    hw_flops = flops.hardware_flops_per_step(model, layout.global_batch_size, layout.recompute, layout.modules)
    return Performance(
        time=time,
        tflops_per_gpu=hw_flops / (step * gpus),
        mfu=model_flops / (step * gpus * gpu.peak("bf16" if prec == "fp8" else prec)),
        model_flops=model_flops,
        hardware_flops=hw_flops,
        tokens_per_second=layout.global_batch_size * model.seq_length / step,
        passes=passes,
    )
