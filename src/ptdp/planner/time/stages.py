"""Per-microbatch time of the pipeline stages: the time terms of the step-time model.

Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473 (§2.2 bubble, §3.2 and §4.1
communication); [K22] Korthikanti et al., arXiv:2205.05198 (§5 selective recompute).

One microbatch on a stage is its layers' compute, the recompute forward, the exposed TP
communication (Megatron-style TP does not overlap it), the context-parallel key/value exchange and
the edge work of the first stage (embedding) and the last (output layer + loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.model import ModelConfig
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import Cluster, GPUType
from ptdp.planner.inputs.moe_model import MoEModel, moe_layer_share, moe_of
from ptdp.planner.memory.cp_local import local_model
from ptdp.planner.time import flops
from ptdp.planner.time.collectives import Links, hierarchical_all_reduce_time, pp_transfer_time, tp_layer_comm_times
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants, links_for
from ptdp.planner.time.cp_exchange import block_attention_times, kv_exchange_times, layer_times, torch_merge_times
from ptdp.planner.time.moe_time import sublayer_times

Parts = tuple[float, ...]
"""Per-microbatch seconds of a stage by part: (compute, recompute, tp_comm, cp_comm, ep_comm)."""


def fp8_gemms(layout: Candidate, gpu: GPUType, c: PerfConstants) -> flops.FP8Gemms | None:
    """How ``layout``'s FP8 GEMMs run on ``gpu`` (None: no FP8): on its FP8 tensor cores (its
    sustained FP8 peak) unless it has none or the recipe is blockwise (planned emulated: ``ptdp
    train``'s kernel depends on its torch), rowwise at ``c.fp8_rowwise_gemm_efficiency``; emulated at its TF32 peak, else its
    float32 one, else that of the parameters' dtype (a calibrated CPU)."""
    if not layout.fp8:
        return None
    recipe, precision = layout.fp8_recipe, layout.precision
    native = "fp8" in gpu.peak_flops and recipe != "blockwise"
    fallback = next(p for p in ("tf32", "fp32", "bf16" if precision == "fp8" else precision) if p in gpu.peak_flops)
    return flops.FP8Gemms(
        recipe,
        gpu.sustained_peak("fp8") if native else 0.0,
        c.fp8_rowwise_gemm_efficiency if recipe == "rowwise" else 1.0,
        gpu.sustained_peak(fallback),
        4.0 if precision == "fp32" else 2.0,
    )


def rank_layer_times(
    model: ModelConfig,
    layout: Candidate,
    peak: float,
    bandwidth: float,
    c: PerfConstants,
    fp8: flops.FP8Gemms | None = None,
) -> tuple[float, float, float, float, float]:
    """(forward, backward, attention core, one block's forward attention, its backward) seconds
    of one layer on one tp and cp rank for one microbatch (:mod:`ptdp.planner.time.cp_exchange`: the
    ``s / cp``-token layer attending ``cp`` blocks; the last two hide one ring step of the
    key/value exchange each)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    times = flops.layer_compute_times(
        local,
        layout.tp,
        layout.micro_batch_size,
        layout.parallel.sequence_parallel,
        peak,
        bandwidth,
        c.gemm_peak_fraction,
        c.gemm_half_dim,
        fp8,
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


def moe_overlap_applies(layout: Candidate) -> bool:
    """Megatron-Core overlaps the MoE exchanges with another micro-batch's compute only with ep > 1,
    the all-to-all (or flex) dispatcher, no full recompute nor recomputed MoE layers, and, with a
    pipeline, interleaved chunks (its configuration refuses the rest)."""
    return (
        layout.ep > 1
        and layout.parallel.moe_token_dispatcher_type != "allgather"
        and layout.recompute != "full"
        and "moe" not in layout.modules
        and (layout.pp == 1 or layout.virtual_stages > 1)
    )


def tp_hidden_share(c: PerfConstants, tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """Shares of the layers' tensor-parallel communication hidden behind their GEMMs, (forward,
    backward and recomputed forward): ``(tp - 1) / tp`` of both with ``c.tp_comm_overlap`` and
    sequence parallelism (Transformer Engine's ring exchange hides all but the first of tp chunks);
    with ``c.async_tp`` of the forward pass only (Inductor's micro-pipeline TP pass matches the
    forward graph's patterns; the backward's reduce-scatters take sums of matmuls, pytorch/pytorch
    PR 149946); else ``c.tp_overlap`` of both."""
    if sequence_parallel and tp > 1:
        if c.tp_comm_overlap:
            share = max(c.tp_overlap, (tp - 1) / tp)
            return share, share
        if c.async_tp:
            return max(c.tp_overlap, (tp - 1) / tp), c.tp_overlap
    return c.tp_overlap, c.tp_overlap


@dataclass(frozen=True)
class LayerTerms:
    """Seconds of one layer on one tp and cp rank for one microbatch, as
    :func:`stage_microbatch_times` adds them up: ``compute`` forward + backward (+ the host overhead),
    ``recompute``, ``tp_comm``, ``cp_comm`` and ``ep_comm`` (exposed), and the forward pass's share
    of each (``forward``: its compute, half the overhead, its tp and cp communication and its
    all-to-alls)."""

    compute: float
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    forward: float
    moe_wgrad: float = 0.0


def layer_terms(
    model: ModelConfig,
    layout: Candidate,
    peak: float,
    bandwidth: float,
    links: Links,
    c: PerfConstants,
    elem: float,
    fp8: flops.FP8Gemms | None = None,
) -> LayerTerms:
    """One layer's :class:`LayerTerms` (see :func:`stage_microbatch_times`)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    tp, b, s, h = layout.tp, layout.micro_batch_size, local.seq_length, model.hidden_size
    fwd, bwd, core, block, block_bwd = rank_layer_times(model, layout, peak, bandwidth, c, fp8)
    full = layout.recompute == "full"
    sub = sublayer_times(
        model,
        tp,
        layout.cp,
        layout.ep,
        layout.etp,
        b,
        layout.parallel.sequence_parallel,
        layout.parallel.moe_token_dispatcher_type,
        layout.modules,
        full,
        peak,
        bandwidth,
        c,
        links,
        elem,
        fp8.native_peak if fp8 is not None else 0.0,
        experts_wgrad_fp8=fp8 is None or fp8.recipe is None,  # ptdp train's experts: wgrad in bf16
    )
    fwd, bwd = fwd + sub.forward, bwd + sub.backward
    exchange = sub.exchange + sub.exchange_again
    exchange_forward = sub.exchange / 2  # two of the four all-to-alls
    if c.moe_overlap and moe_overlap_applies(layout):  # behind another micro-batch's compute, slowed by them
        hidden = min(exchange, fwd + bwd)
        exchange_forward *= 1.0 - hidden / exchange if exchange else 0.0
        fwd += c.moe_overlap_slowdown * hidden * fwd / (fwd + bwd)
        bwd += c.moe_overlap_slowdown * hidden * bwd / (fwd + bwd)
        exchange -= hidden
    tp_f, tp_b = tp_layer_comm_times(
        b * s, h, tp, sequence_parallel=layout.parallel.sequence_parallel, links=links, bytes_per_element=elem
    )
    hidden_f, hidden_b = tp_hidden_share(c, tp, layout.parallel.sequence_parallel)
    tp_again = (1.0 - hidden_b) * tp_f  # a recomputed forward's, hidden as backward's
    # an MoE layer's routed experts take its sequence shard: without a shared expert (whose MLP
    # gathers and scatters as a dense one does) only its attention's collectives run over tp
    moe = moe_of(model)
    attention_only = 1.0 - moe_layer_share(model) / 2.0 if moe is not None and not moe.shared_ffn else 1.0
    tp_f, tp_b = (1.0 - hidden_f) * tp_f * attention_only, (1.0 - hidden_b) * tp_b * attention_only
    cp_f, cp_b = kv_exchange_times(model, tp, layout.cp, b, layout.parallel.cp_comm_type, block, links, elem, block_bwd)
    if c.cp_implementation == "torch":
        merge_f, merge_b = torch_merge_times(model, tp, layout.cp, b, bandwidth)
        cp_f, cp_b = cp_f + merge_f, cp_b + merge_b
    rec = {"full": fwd, "selective": core if "core_attn" in layout.modules else 0.0}.get(layout.recompute, 0.0)
    if layout.recompute == "selective":
        rec += sub.recompute
        args = (local, tp, b, layout.parallel.sequence_parallel)
        consts = (peak, bandwidth, c.gemm_peak_fraction, c.gemm_half_dim)
        rec += flops.module_recompute_time(*args, tuple(m for m in layout.modules if m != "mlp"), *consts)
        if "mlp" in layout.modules:  # the dense layers' MLPs: Megatron-Core recomputes no MoE layer so
            dense = 1.0 - moe_layer_share(model)
            rec += dense * flops.module_recompute_time(*args, ("mlp",), *consts)
    if layout.recompute == "op":
        rec = flops.op_sac_recompute_time(
            local,
            tp,
            b,
            layout.parallel.sequence_parallel,
            peak,
            bandwidth,
            c.gemm_peak_fraction,
            c.gemm_half_dim,
        )
    rec_comm, rec_cp = (tp_again * attention_only, cp_f) if full else (0.0, 0.0)
    if "mlp" in layout.modules:  # the (dense) MLP's all-gather / reduce-scatter (or all-reduce) again
        rec_comm = tp_again / 2 * (1.0 - moe_layer_share(model))
    return LayerTerms(
        fwd + bwd + c.layer_overhead,
        rec,
        tp_f + tp_b + rec_comm,
        cp_f + cp_b + rec_cp,
        exchange,
        fwd + c.layer_overhead / 2 + tp_f + cp_f + exchange_forward,
        sub.wgrad,
    )


def stage_microbatch_times(
    model: ModelConfig,
    layout: Candidate,
    peak: float,
    bandwidth: float,
    links: Links,
    c: PerfConstants,
    v_pad: int,
    elem: float,
    layers: int,
    fp8: flops.FP8Gemms | None = None,
) -> tuple[Parts, Parts, Parts]:
    """(compute, recompute, tp_comm, cp_comm, ep_comm) seconds of one microbatch on (middle, first, last)
    stages of one cp rank (a planned MoE / MLA model's layers changed by
    :func:`ptdp.planner.time.moe_time.sublayer_times`, ep_comm its exposed exchanges) (:func:`rank_layer_times`; tp transfers and logits of ``s / cp`` tokens,
    key/value exchange :func:`ptdp.planner.time.cp_exchange.kv_exchange_times` and, with
    ``c.cp_implementation`` torch, :func:`ptdp.planner.time.cp_exchange.torch_merge_times`, again in a
    full recompute);
    ``fp8``: the layers' weight GEMMs in FP8 (:func:`fp8_gemms`)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    tp, b, h = layout.tp, layout.micro_batch_size, model.hidden_size
    s = local.seq_length
    t = layer_terms(model, layout, peak, bandwidth, links, c, elem, fp8)
    mid = (layers * t.compute, layers * t.recompute, layers * t.tp_comm, layers * t.cp_comm, layers * t.ep_comm)
    one_ar = hierarchical_all_reduce_time(elem * b * s * h, tp, links.gpus_per_node, links)
    logits = flops.logits_compute_time(local, tp, b, v_pad, peak, bandwidth, c.gemm_peak_fraction, c.gemm_half_dim)
    if isinstance(model, MoEModel) and model.mtp_layers:  # each MTP module's projection and output layer again
        tokens = b * local.seq_length
        proj = flops.gemm_time(
            tokens,
            h // tp,
            2 * h,
            1,
            peak_flops=peak,
            bandwidth=bandwidth,
            peak_fraction=c.gemm_peak_fraction,
            half_dim=c.gemm_half_dim,
        )
        logits *= 1 + model.mtp_layers
        logits += model.mtp_layers * 3.0 * proj
    first = (mid[0], mid[1], mid[2] + one_ar, *mid[3:])
    last = (mid[0] + logits + c.head_overhead, mid[1], mid[2] + one_ar, *mid[3:])
    if layout.pp == 1:
        last = (last[0], last[1], last[2] + one_ar, *last[3:])
    return mid, first, last


def layer_passes(
    model: ModelConfig,
    layout: Candidate,
    peak: float,
    bandwidth: float,
    links: Links,
    c: PerfConstants,
    elem: float,
    fp8: flops.FP8Gemms | None = None,
) -> tuple[float, float, float]:
    """(F, B, W) seconds of one layer on one tp and cp rank for one microbatch when the backward is
    split (the zero-bubble schedules): F the forward's share of :func:`layer_terms`, W its
    weight-gradient GEMMs (:func:`ptdp.planner.time.flops.layer_wgrad_time` of the ``s / cp``-token
    layer, at the GEMM efficiency of the whole backward, and an MoE layer's experts'), B the rest of the layer's microbatch
    (backward, recompute and their communication)."""
    local = local_model(model, layout.cp) if layout.cp > 1 else model
    t = layer_terms(model, layout, peak, bandwidth, links, c, elem, fp8)
    wgrad = flops.layer_wgrad_time(
        local, layout.tp, layout.micro_batch_size, peak, bandwidth, c.gemm_peak_fraction, c.gemm_half_dim, fp8
    )
    wgrad += t.moe_wgrad
    total = t.compute + t.recompute + t.tp_comm + t.cp_comm + t.ep_comm
    return t.forward, total - t.forward - wgrad, wgrad


def split_stage_times(
    split: tuple[int, ...], layer: tuple[float, ...], first: tuple[float, ...], last: tuple[float, ...]
) -> tuple[Parts, Parts, Parts, Parts, float]:
    """Per-microbatch times of the stages of an uneven split, from ``layer`` (one layer's parts) and
    ``first`` / ``last`` (one layer plus that stage's edge work). Returns (first stage, mean of the
    middle stages, last stage, busiest stage, fill seconds); fill and drain take the layers-only time
    of the other stages, ``(sum(split) - split[busiest]) * sum(layer)`` ([N21] §2.2 generalised: a 1F1B
    step is about ``m max t_i + sum of the others``). Needs ``len(split) >= 2``.
    """
    head = tuple(split[0] * u + (f - u) for f, u in zip(first, layer))
    tail = tuple(split[-1] * u + (x - u) for x, u in zip(last, layer))
    one = sum(layer)
    loads = [n * one for n in split]
    loads[0], loads[-1] = sum(head), sum(tail)
    busiest = max(range(len(split)), key=lambda i: (loads[i], i))
    middle = split[1:-1]
    mean = tuple(sum(middle) * u / len(middle) for u in layer) if middle else tuple(0.0 for _ in layer)
    stage = head if busiest == 0 else tail if busiest == len(split) - 1 else tuple(split[busiest] * u for u in layer)
    fill = (sum(split) - split[busiest]) * one
    return head, mean, tail, stage, fill


def edge_layer_equivalents(
    model: ModelConfig,
    layout: Candidate,
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
    peak = gpu.sustained_peak("bf16" if prec == "fp8" else prec)
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, layout.tp)
    elem = 4.0 if prec == "fp32" else 2.0
    bandwidth = gpu.memory_bandwidth * c.hbm_efficiency
    fp8 = fp8_gemms(layout, gpu, c)
    layer, first, last = stage_microbatch_times(
        model, layout, peak, bandwidth, links_for(cluster, c), c, v_pad, elem, 1, fp8
    )
    unit = sum(layer)
    return (sum(first) - unit) / unit, (sum(last) - unit) / unit


def pipeline_transfer_time(model: ModelConfig, layout: Candidate, links: Links, elem: float, c: PerfConstants) -> float:
    """Seconds of one microbatch's stage-to-stage transfers on a pipeline rank: two per model chunk
    (activations forward, their gradients backward), ``2 v`` transfers of the ``b s / cp`` tokens'
    ``elem``-byte hidden states (:func:`ptdp.planner.time.collectives.pp_transfer_time`; split over the tp ranks
    and all-gathered with ``c.pp_scatter_gather``, [N21] §4.1)."""
    return (
        2.0
        * layout.virtual_stages
        * pp_transfer_time(
            layout.micro_batch_size * model.seq_length // layout.cp,
            model.hidden_size,
            layout.tp,
            layout.shard_size,
            layout.pp,
            sequence_parallel=layout.parallel.sequence_parallel,
            links=links,
            bytes_per_element=elem,
            scatter_gather=c.pp_scatter_gather,
        )
    )
