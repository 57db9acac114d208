"""The time model's tunable constants (:class:`PerfConstants`) and the link bandwidths they give.

The step-time model that uses them is :mod:`ptdp.planner.time.step_time`; the fit of the two fitted ones is
:mod:`ptdp.planner.validate.accuracy`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.time.collectives import Links


@dataclass(frozen=True)
class PerfConstants:
    """Every tunable constant of the time model, with its physical meaning.

    "Fitted": jointly by least squares of ln(predicted / reported) over ``published_runs.csv`` (Megatron
    SC21 Table 1, Korthikanti et al. 2022 Table 5; A100-80GB); ``arch_fits`` holds other generations'
    fits (:meth:`for_gpu`). The others are set from physics or the software's defaults.

    Attributes:
        gemm_peak_fraction: fraction of tensor-core peak a large 16-bit GEMM reaches in a step; fitted.
        gemm_half_dim: GEMM dimension at which tile quantisation halves speed (64: half a 128-wide tile).
        hbm_efficiency: achieved fraction of datasheet HBM bandwidth by memory-bound kernels; fitted.
        nvlink_efficiency: achieved NCCL bus bandwidth in a node / NVLink bandwidth per direction.
        network_efficiency: achieved inter-node bandwidth / NIC line rate per GPU (InfiniBand payload).
        nvlink_latency, network_latency: seconds per ring step of a collective (launch + link latency).
        dp_overlap: fraction of the end-of-step data-parallel reduction hidden behind compute (0: none).
        overlap_window: DP reduction hidden up to one microbatch's compute (``--overlap-grad-reduce``).
        pp_scatter_gather: pipeline messages split over tp ranks, all-gathered on NVLink ([N21] §4.1).
        layer_overhead: host seconds per layer per microbatch not hidden (0 on GPUs; ``--calibrate``).
        head_overhead: the same for the last stage's output layer and loss.
        optimizer_efficiency: optimizer step's fraction of memory-bound bandwidth (1 on GPUs; ``--calibrate``).
        tp_overlap: fraction of TP communication hidden behind GEMMs (TE comm-GEMM overlap: ``(tp - 1) / tp``).
        tp_comm_overlap: TE comm-GEMM overlap switch (Megatron ``--tp-comm-overlap``; sequence parallel only).
        async_tp: PyTorch's asynchronous TP instead (torchtitan ``enable_async_tensor_parallel``: Inductor's
            micro-pipeline TP pass decomposes the forward graph's all-gather -> matmul and matmul ->
            reduce-scatter; sequence parallel only): ``(tp - 1) / tp`` of the forward pass's TP
            communication hidden, none of backward's or of a recomputed forward's.
        pp_overlap: interleaved steady-state transfers overlap compute (Megatron ``overlap_p2p_comm``; NeMo
            docs, Communication Overlap; Llama 3 paper §3.3.2).
        cp_implementation: the context-parallel implementation the run uses (``--cp-implementation``):
            ``te`` (Transformer Engine's fused merge, not counted) or ``torch`` (PyTorch's experimental
            ``context_parallel``: :func:`ptdp.planner.time.cp_exchange.torch_merge_times` added).
        arch_fits: ``(arch, gemm_peak_fraction, gemm_half_dim, hbm_efficiency)`` per GPU architecture;
            Hopper fitted on ``published_runs_h100.csv``, half_dim 128 (half a 256-wide tile); Blackwell
            on ``published_moe_validation_blackwell.csv`` (:func:`~ptdp.planner.validate.published_moe.fit_moe_arch`).
        moe_arch_fits: ``(arch, *MOE_FIT_FIELDS)``: the MoE constants below of an architecture with its
            own fit (Blackwell, on ``published_moe_validation_blackwell.csv``); the others (Hopper,
            whose fit the plain fields hold, Ampere, a calibrated device) use the plain fields.
        moe_grouped_gemm_efficiency: speed of the experts' grouped GEMM over one GEMM of each group's
            shape (launch and scheduling of many groups); fitted on ``published_moe_validation.csv``, or measured by ``--calibrate``.
        moe_exchange_efficiency: achieved fraction of the links' bandwidth by the MoE all-to-alls
            (NCCL's, uneven, many small messages); fitted on ``published_moe_validation.csv``, or measured by
            ``--calibrate``.
        moe_flex_efficiency: the same for the deduplicating flex dispatcher's kernels (DeepEP,
            HybridEP); fitted there too.
        moe_layer_overhead: seconds per MoE layer and micro-batch (forward and backward) of the
            layer's small kernels (router, top-k, permutation bookkeeping, launches) beyond their
            bytes; fitted on ``published_moe_validation.csv``.
        moe_overlap: the MoE exchanges run behind another micro-batch's compute (Megatron-Core
            ``--overlap-moe-expert-parallel-comm``; planner only).
        cuda_graphs: the run captures CUDA graphs (Megatron-Core ``--cuda-graph-impl``; planner
            only), which Megatron-Core runs without full recompute: the search leaves it out.
        moe_cuda_graphs: the graphs replay the MoE layers' router (a scope that holds it): the
            layers' ``moe_layer_overhead`` is not paid.
        moe_overlap_slowdown: seconds of compute lost per second of exchange hidden behind it (the
            streaming multiprocessors the communication kernels hold while they run); fitted on
            ``published_moe_validation.csv``.
        moe_flex_dispatcher: the deduplicating exchange the run uses (Megatron-Core's ``flex``
            dispatcher, ``--moe-flex-dispatcher-backend`` deepep or hybridep; planner only), "" for
            the plain all-to-all.
        fp8_rowwise_gemm_efficiency: speed of an FP8 GEMM with per-row scales (``--fp8-recipe
            rowwise``) over a tensorwise one. From torchao's float8 README (github.com/pytorch/ao,
            torchao/float8, Llama3-8B on 8 H100, torchtitan): tensorwise 1.25x and rowwise 1.10x
            bf16's throughput. If tensorwise's GEMMs run twice bf16's (the peaks' ratio), GEMMs are
            40% of the bf16 step, rowwise's run 1.30x bf16's, 0.65 of tensorwise's (rowwise's
            costlier casts lumped in).
        wgrad_efficiency: speed of the weight-gradient GEMMs a zero-bubble schedule's W runs apart
            from their B (:func:`ptdp.planner.time.flops.layer_wgrad_time`) over the same GEMMs in a
            whole backward, on a GPU generation without its own entry in ``wgrad_arch_efficiency``.
        wgrad_arch_efficiency: ``(arch, wgrad_efficiency)`` per GPU generation. An assumption, not
            measured or fitted: 1.0 on Ampere, Hopper and Blackwell (a W GEMM has the shape and
            operands it has inside the whole backward; the planner's GEMM efficiency is symmetric
            in its dimensions); a calibrated profile may set its own.
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
    tp_comm_overlap: bool = False
    async_tp: bool = False
    pp_overlap: bool = False
    cp_implementation: str = "te"
    arch_fits: tuple[tuple[str, float, float, float], ...] = (
        ("hopper", 0.58, 128.0, 0.85),
        ("blackwell", 0.80, 64.0, 0.60),
    )
    moe_grouped_gemm_efficiency: float = 1.1
    moe_exchange_efficiency: float = 1.0
    moe_flex_efficiency: float = 1.0
    moe_layer_overhead: float = 3e-3
    moe_overlap: bool = False
    moe_overlap_slowdown: float = 0.5
    cuda_graphs: bool = False
    moe_cuda_graphs: bool = False
    moe_flex_dispatcher: str = ""
    fp8_rowwise_gemm_efficiency: float = 0.65
    moe_arch_fits: tuple[tuple[str, float, float, float, float, float], ...] = (
        ("blackwell", 0.5, 0.3, 0.8, 0.75e-3, 0.0),
    )
    wgrad_efficiency: float = 1.0
    wgrad_arch_efficiency: tuple[tuple[str, float], ...] = (("ampere", 1.0), ("hopper", 1.0), ("blackwell", 1.0))

    def __post_init__(self) -> None:  # a profile read from JSON holds lists
        object.__setattr__(self, "arch_fits", tuple(tuple(fit) for fit in self.arch_fits))
        object.__setattr__(self, "moe_arch_fits", tuple(tuple(fit) for fit in self.moe_arch_fits))
        object.__setattr__(self, "wgrad_arch_efficiency", tuple(tuple(e) for e in self.wgrad_arch_efficiency))

    def with_overlap(
        self,
        *,
        overlap_grad_reduce: bool,
        tp_comm_overlap: bool = False,
        pp_overlap: bool = False,
        async_tp: bool = False,
    ) -> PerfConstants:
        """These constants for a run with that communication overlap: ``overlap_window`` on with
        ``overlap_grad_reduce`` (kept on if already), ``tp_comm_overlap``, ``pp_overlap`` and
        ``async_tp`` as given."""
        return dataclasses.replace(
            self,
            overlap_window=self.overlap_window or overlap_grad_reduce,
            tp_comm_overlap=tp_comm_overlap,
            pp_overlap=pp_overlap,
            async_tp=async_tp,
        )

    def for_gpu(self, gpu) -> PerfConstants:
        """These constants with ``gpu.arch``'s fitted efficiencies (``arch_fits``, ``moe_arch_fits``)
        and W efficiency (``wgrad_arch_efficiency``), or unchanged for an architecture without its
        own (Ampere, whose fit the plain fields hold; a calibrated CPU)."""
        return _for_arch(self, getattr(gpu, "arch", ""))

    def moe_fit(self, arch: str) -> dict[str, float]:
        """The MoE constants (:data:`MOE_FIT_FIELDS`) that :meth:`for_gpu` gives ``arch``."""
        fits = {fit[0]: fit[1:] for fit in self.moe_arch_fits}
        return dict(zip(MOE_FIT_FIELDS, fits.get(arch) or [getattr(self, name) for name in MOE_FIT_FIELDS]))

    def with_moe_fit(self, arch: str, values: dict[str, float]) -> PerfConstants:
        """These constants with ``values`` (some of :data:`MOE_FIT_FIELDS`) as ``arch``'s MoE
        constants: in its ``moe_arch_fits`` entry, or the plain fields for an architecture without one."""
        if all(fit[0] != arch for fit in self.moe_arch_fits):
            return dataclasses.replace(self, **values)  # type: ignore[arg-type]
        merged = {**self.moe_fit(arch), **values}
        grouped, exchange, flex, overhead, slowdown = (float(merged[name]) for name in MOE_FIT_FIELDS)
        entry = (arch, grouped, exchange, flex, overhead, slowdown)
        fits = tuple(entry if fit[0] == arch else fit for fit in self.moe_arch_fits)
        return dataclasses.replace(self, moe_arch_fits=fits)


#: The MoE constants an architecture's fit holds (:attr:`PerfConstants.moe_arch_fits`), in its order
MOE_FIT_FIELDS = (
    "moe_grouped_gemm_efficiency",
    "moe_exchange_efficiency",
    "moe_flex_efficiency",
    "moe_layer_overhead",
    "moe_overlap_slowdown",
)


@lru_cache(maxsize=256)
def _for_arch(constants: PerfConstants, arch: str) -> PerfConstants:
    out = constants
    for name, gemm, half_dim, hbm in constants.arch_fits:
        if name == arch:
            out = dataclasses.replace(out, gemm_peak_fraction=gemm, gemm_half_dim=half_dim, hbm_efficiency=hbm)
    for name, *moe in constants.moe_arch_fits:
        if name == arch:
            out = dataclasses.replace(out, **dict(zip(MOE_FIT_FIELDS, moe)))  # type: ignore[arg-type]
    for name, efficiency in constants.wgrad_arch_efficiency:
        if name == arch and efficiency != out.wgrad_efficiency:
            out = dataclasses.replace(out, wgrad_efficiency=efficiency)
    if out is constants:
        return constants
    return dataclasses.replace(out, arch_fits=(), moe_arch_fits=(), wgrad_arch_efficiency=())


DEFAULT_CONSTANTS = PerfConstants()


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
