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

    Two are fitted, jointly, by least squares of ln(predicted / reported) over the 18 published
    runs of ``published_runs.csv`` (Megatron SC21 Table 1 TFLOP/s and Korthikanti et al. 2022
    Table 5 iteration times, all on A100-80GB; ``python -m ptdp.planner.validate.accuracy --fit``, results
    in BENCHMARKS.md), never per run. The others are set from physics or defaults of the software.
    Where the physics of a GPU generation differs, ``arch_fits`` holds that generation's own
    values of the GEMM and HBM efficiencies (:meth:`for_gpu`), fitted the same way on its
    published runs (Hopper: ``published_runs_h100.csv``).

    Attributes:
        gemm_peak_fraction: fraction of the tensor-core peak a large, well-shaped 16-bit GEMM
            reaches inside a training step (cuBLAS kernels, clock under sustained load).
            Fitted.
        gemm_half_dim: GEMM dimension at which tile/wave quantisation halves the speed
            (:func:`ptdp.planner.time.flops.gemm_efficiency`); 64 = half a 128-wide tensor-core tile.
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
            :func:`ptdp.planner.validate.accuracy.run_constants` sets it for each published run that
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
            (:func:`ptdp.planner.validate.accuracy.run_constants`).
        tp_comm_overlap: Transformer Engine's comm-GEMM overlap as a switch (``ptdp plan
            --tp-comm-overlap``, Megatron's flag): the layers' tensor-parallel communication is
            hidden by ``(tp - 1) / tp`` at each layout's own tp, with sequence parallelism only
            (the overlap splits the all-gather and reduce-scatter that sequence parallelism uses;
            Megatron refuses ``--tp-comm-overlap`` without it). ptdp's engine does not overlap them.
        pp_overlap: with the interleaved schedule (``v > 1``), the steady state's stage-to-stage
            transfers run while the next model chunk computes and only their excess over that
            compute is exposed; the fill and drain transfers stay in the bubble. Megatron's
            ``overlap_p2p_comm`` (on by default for the interleaved schedule; NeMo documents it:
            "PP communication overlap ... in the 1F1B stage ... The PP communications in pipeline
            fill and flush are still exposed", NeMo docs, Communication Overlap) and the Llama 3
            runs' asynchronous point-to-point communication (Llama 3 paper, section 3.3.2).
            ``ptdp plan --overlap-p2p-communication``; ptdp's runtime waits for each transfer
            group before the compute that needs it, so off for ptdp's own runs.
        arch_fits: per GPU architecture (:attr:`ptdp.planner.inputs.hardware.GPUType.arch`), that
            generation's ``(arch, gemm_peak_fraction, gemm_half_dim, hbm_efficiency)``. Hopper
            (H100, H200): 0.58 and 0.85 fitted jointly by least squares over the 13 published H100
            bf16 runs without context parallelism, each with the overlap it used (``python -m ptdp.planner.validate.accuracy
            benchmarks/data/published_runs_h100.csv --fit``), ``gemm_half_dim`` 128 set: Hopper's
            tensor-core GEMMs run 128 x 256 tiles (warp-group MMAs of 64 x N), half of a 256-wide
            tile, twice Ampere's. 0.58 x 989.5 = 574 TFLOP/s for a large bf16 GEMM in a training
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
    tp_comm_overlap: bool = False
    pp_overlap: bool = False
    arch_fits: tuple[tuple[str, float, float, float], ...] = (("hopper", 0.58, 128.0, 0.85),)

    def __post_init__(self) -> None:  # a profile read from JSON holds lists
        object.__setattr__(self, "arch_fits", tuple(tuple(fit) for fit in self.arch_fits))

    def with_overlap(
        self, *, overlap_grad_reduce: bool, tp_comm_overlap: bool = False, pp_overlap: bool = False
    ) -> PerfConstants:
        """These constants for a run with that communication overlap: ``overlap_window`` on with
        ``overlap_grad_reduce`` (kept on if already), ``tp_comm_overlap`` and ``pp_overlap`` as
        given. The one place ``ptdp plan``'s flags, ``ptdp train``'s report and the published runs'
        columns become the time model's overlap."""
        return dataclasses.replace(
            self,
            overlap_window=self.overlap_window or overlap_grad_reduce,
            tp_comm_overlap=tp_comm_overlap,
            pp_overlap=pp_overlap,
        )

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
