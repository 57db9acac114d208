"""The fits of ``ptdp plan --calibrate``: the hardware profile from what the workers measured.

Pure arithmetic on the measurements of :mod:`ptdp.run.calibration` (no torch): the GEMM-efficiency
curve (peak FLOP/s and half-dim of :func:`ptdp.planner.time.flops.gemm_efficiency`), the ring model's
link bandwidth and latency (:mod:`ptdp.planner.time.collectives`), the host overhead per layer and per output
layer beyond the planner's prediction, the optimizer's share of the memory bandwidth, and the two
MoE efficiencies (the all-to-all's share of the fitted links, the experts' grouped GEMM's of the
fitted roofline; :mod:`ptdp.planner.time.moe_time`); together a
:class:`~ptdp.planner.inputs.hardware.GPUType` ("local") and its
:class:`~ptdp.planner.time.constants.PerfConstants` (:func:`build_profile`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
from functools import partial

from ptdp.config.model import ModelConfig
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.inputs.hardware import Cluster, GPUType
from ptdp.planner.time.collectives import Links, hierarchical_all_reduce_time, tp_layer_comm_times
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants, links_for
from ptdp.planner.time.data_parallel import OPT_BYTES_FULL, OPT_BYTES_SHARDED
from ptdp.planner.time.flops import gemm_efficiency, layer_compute_times, logits_compute_time
from ptdp.planner.time.moe_time import exchange_time, experts_gemm_time


def fit_linear(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of ``t = latency + bytes / bandwidth`` (least squares)."""
    xs, ys = [float(n) for n, _ in samples], [t for _, t in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 1.0 / max(slope, 1e-30), max(my - slope * mx, 0.0)


def fit_gemm_curve(samples: list[dict]) -> tuple[float, float]:
    """(peak FLOP/s, half_dim) so that peak * prod(x/(x+half_dim)) best fits the samples (log LSQ)."""
    fits = []  # (squared log error, peak, half_dim) per candidate half_dim
    for half_dim in [0.0] + [2.0 ** (i / 4) for i in range(0, 36)]:
        logs = [
            math.log(s["flops_per_s"])
            - math.log(gemm_efficiency(s["m"], s["n"], s["k"], peak_fraction=1.0, half_dim=half_dim))
            for s in samples
        ]
        log_peak = sum(logs) / len(logs)
        fits.append((sum((x - log_peak) ** 2 for x in logs), math.exp(log_peak), half_dim))
    _, peak, half_dim = min(fits, key=lambda fit: fit[0])  # the first smallest error
    return peak, half_dim


def fit_ring(samples: list[tuple[int, float]], group_size: int | list[int]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per ring step) of ``t = 2(g-1) lat + 2(g-1)/g * bytes / bw``,
    least squares over (bytes, seconds) samples taken on groups of ``group_size`` (one size for
    all, or one per sample)."""
    sizes = [group_size] * len(samples) if isinstance(group_size, int) else list(group_size)
    rows = [(2.0 * (g - 1), 2.0 * (g - 1) / g * n, t) for (n, t), g in zip(samples, sizes)]
    # normal equations of t = a x1 + c x2 (a: latency, c: 1 / bandwidth)
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    s1t = sum(x1 * t for x1, _, t in rows)
    s2t = sum(x2 * t for _, x2, t in rows)
    det = s11 * s22 - s12 * s12
    latency = (s1t * s22 - s2t * s12) / det
    inv_bw = (s11 * s2t - s12 * s1t) / det
    if latency < 0.0:  # refit through the origin
        latency, inv_bw = 0.0, s2t / s22
    return 1.0 / max(inv_bw, 1e-30), latency


def fit_exchange_efficiency(samples: list[tuple[int, int, float]], links: Links) -> float:
    """``moe_exchange_efficiency`` from all-to-alls measured as (group size, bytes each rank sends,
    seconds): :func:`~ptdp.planner.time.moe_time.exchange_time` at efficiency ``e`` is its latency
    plus ``x / e`` (``x``: its transfer time at efficiency 1 on ``links``); ``1 / e`` by least
    squares through the origin of ``seconds - latency = x / e``. 1.0 when no time exceeds the
    latency (nothing to fit)."""
    rows = []
    for group, nbytes, seconds in samples:
        latency = exchange_time(0.0, group, links)
        rows.append((exchange_time(nbytes, group, links) - latency, seconds - latency))
    sxx = sum(x * x for x, _ in rows)
    sxy = sum(x * y for x, y in rows)
    return sxx / sxy if sxx > 0.0 and sxy > 0.0 else 1.0


def fit_grouped_gemm_efficiency(
    samples: list[dict], *, peak_flops: float, bandwidth: float, half_dim: float, bytes_per_element: float
) -> float:
    """``moe_grouped_gemm_efficiency`` from the experts' forward GEMMs measured at ``{"experts",
    "rows", "hidden", "ffn", "seconds"}``: the geometric mean over the samples of the planner's
    time at efficiency 1 (:func:`~ptdp.planner.time.moe_time.experts_gemm_time` with the fitted peak
    and half-dim) over the measured seconds."""
    predicted = partial(
        experts_gemm_time,
        peak_flops=peak_flops,
        bandwidth=bandwidth,
        peak_fraction=1.0,
        half_dim=half_dim,
        element=bytes_per_element,
    )
    logs = [
        math.log(predicted(s["experts"], s["rows"], s["hidden"], s["ffn"], s["ffn"]) / s["seconds"]) for s in samples
    ]
    return math.exp(sum(logs) / len(logs))


def fit_overheads(
    model: ModelConfig, config, gpu: GPUType, constants: PerfConstants, precision: str, layer_s: float, head_s: float
) -> tuple[float, float]:
    """(layer_overhead, head_overhead): measured seconds of one real layer / output layer + loss
    (forward + backward, one microbatch) minus the planner's prediction from the primitives."""
    tp, b, m = config.parallel.tp, config.train.micro_batch_size, config.model
    peak, bw = gpu.peak(precision), gpu.memory_bandwidth
    links = links_for(Cluster(gpu, gpu.gpus_per_node, gpu.gpus_per_node), constants)
    elem = 4.0 if precision == "fp32" else 2.0
    fwd, bwd, _ = layer_compute_times(model, tp, b, False, peak, bw, 1.0, constants.gemm_half_dim)
    comm_f, comm_b = tp_layer_comm_times(
        b * model.seq_length, model.hidden_size, tp, sequence_parallel=False, links=links, bytes_per_element=elem
    )
    v_pad = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    head = logits_compute_time(
        model, tp, b, v_pad, peak, bw, 1.0, constants.gemm_half_dim
    ) + hierarchical_all_reduce_time(elem * b * model.seq_length * model.hidden_size, tp, links.gpus_per_node, links)
    return max(0.0, layer_s - (fwd + bwd + comm_f + comm_b)), max(0.0, head_s - head)


def _fit_link(mine: dict, bandwidth: float) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the links: the ring fit of the all-reduces, else the
    linear fit of the pipeline ping-pong, else (one worker) the memory ``bandwidth`` and no latency."""
    if mine["all_reduce"]:
        return fit_ring([(n, t) for _, n, t in mine["all_reduce"]], [g for g, _, _ in mine["all_reduce"]])
    if mine.get("p2p"):
        return fit_linear(mine["p2p"])
    return bandwidth, 0.0


def _local_gpu(
    precision: str, peak: float, bandwidth: float, link_bw: float, nproc: int, cores: int, device: dict | None
) -> GPUType:
    """The measured "local" device: on CPUs (``device`` None) the machine's memory shared by the
    ``nproc`` workers, on GPUs rank 0's device memory."""
    if device is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc
        what = f"{platform.processor() or platform.machine()}, {cores} cores"
    else:
        memory, what = float(device["memory_bytes"]), f"{nproc} x {device['name']}"
    return GPUType(
        name="local",
        peak_flops={precision: peak},
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        nvlink_bandwidth=link_bw,
        network_bandwidth=link_bw,
        gpus_per_node=nproc,
        source=f"ptdp plan --calibrate on {platform.node()} ({what}, {nproc} workers) "
        f"{datetime.date.today().isoformat()}",
        shared_cores=cores,
    )


def build_profile(
    mine: dict, config, precision: str, cores: int, device: dict | None = None
) -> tuple[GPUType, PerfConstants, dict]:
    """The profile from the measurements in ``mine``: rank 0's GEMMs and bandwidth; tensor-parallel
    group 0's medians of all-reduce, layer and head times (already scaled to one core per worker);
    the pipeline ping-pong (``p2p``, when pp > 1); the world's all-to-alls (``all_to_all``: (group,
    bytes, seconds), scaled the same way) and rank 0's experts' GEMMs (``grouped_gemm``), each
    optional (the default MoE efficiencies stay without them). ``cores``: the CPU cores the
    workers share (0: none, each worker has a GPU). ``device``: ``{"name", "memory_bytes"}`` of rank 0's GPU, None
    on CPUs (the machine's memory is then shared by the workers)."""
    nproc = config.world_size
    peak, half_dim = fit_gemm_curve(mine["gemms"])
    bandwidth = mine["bandwidth"]
    link_bw, latency = _fit_link(mine, bandwidth)
    gpu = _local_gpu(precision, peak, bandwidth, link_bw, nproc, cores, device)
    constants = dataclasses.replace(
        DEFAULT_CONSTANTS,
        gemm_peak_fraction=1.0,
        gemm_half_dim=half_dim,
        hbm_efficiency=1.0,
        nvlink_efficiency=1.0,
        network_efficiency=1.0,
        nvlink_latency=latency,
        network_latency=latency,
        pp_scatter_gather=False,
    )
    layer_overhead, head_overhead = fit_overheads(
        config.model, config, gpu, constants, precision, mine["layer_s"], mine["head_s"]
    )
    opt_params, opt_s = mine["optimizer"]
    opt_efficiency = min(
        1.0, opt_params * (OPT_BYTES_FULL[precision] + OPT_BYTES_SHARDED[precision]) / bandwidth / opt_s
    )
    exchange_eff, grouped_eff = constants.moe_exchange_efficiency, constants.moe_grouped_gemm_efficiency
    if mine.get("all_to_all"):
        exchange_eff = fit_exchange_efficiency(mine["all_to_all"], links_for(Cluster(gpu, nproc, nproc), constants))
    if mine.get("grouped_gemm"):
        grouped_eff = fit_grouped_gemm_efficiency(
            mine["grouped_gemm"],
            peak_flops=peak,
            bandwidth=bandwidth,
            half_dim=half_dim,
            bytes_per_element=4.0 if precision == "fp32" else 2.0,
        )
    constants = dataclasses.replace(
        constants,
        layer_overhead=layer_overhead,
        head_overhead=head_overhead,
        optimizer_efficiency=opt_efficiency,
        moe_exchange_efficiency=exchange_eff,
        moe_grouped_gemm_efficiency=grouped_eff,
    )
    measured = {
        "gemms": mine["gemms"],
        "add_bandwidth": bandwidth,
        "all_reduce": mine["all_reduce"],
        "layer_s": mine["layer_s"],
        "head_s": mine["head_s"],
        "p2p": mine.get("p2p"),
        "all_to_all": mine.get("all_to_all"),
        "grouped_gemm": mine.get("grouped_gemm"),
        "cores": cores,
        "workers": nproc,
        "fitted": {
            "peak_flops": peak,
            "gemm_half_dim": half_dim,
            "link_bandwidth": link_bw,
            "link_latency": latency,
            "layer_overhead": layer_overhead,
            "head_overhead": head_overhead,
            "optimizer_efficiency": opt_efficiency,
            "moe_exchange_efficiency": exchange_eff,
            "moe_grouped_gemm_efficiency": grouped_eff,
        },
        "optimizer_s": opt_s,
    }
    return gpu, constants, measured
