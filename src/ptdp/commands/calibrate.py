"""``ptdp plan --calibrate``: start the measuring workers (:mod:`ptdp.run.calibration`) and report the profile.

Dispatched by :mod:`ptdp.cli`, so that ``ptdp plan`` without ``--calibrate`` imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import DEFAULT_LOCAL_WORKERS, resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.config.train_flags import DEFAULT_PP, DEFAULT_TP
from ptdp.errors import ConfigError
from ptdp.planner.inputs.plan_flags import plan_precision
from ptdp.planner.time.profile import default_profile_path
from ptdp.run.calibration import calibrate_worker


def calibration_workers(args: argparse.Namespace) -> int:
    """``--nproc-per-node``, else the visible GPUs (8 without CUDA); ConfigError when it is not
    positive or exceeds the visible GPUs (naming both)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (gpus or DEFAULT_LOCAL_WORKERS)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc} must be a positive integer")
    if gpus is not None and nproc > gpus:
        raise ConfigError(
            f"--nproc-per-node {nproc} calibration workers but this machine shows only {gpus} GPU(s) "
            f"(torch.cuda.device_count()): each worker measures on a GPU of its own"
        )
    return nproc


def calibration_config(args: argparse.Namespace, nproc: int | None = None) -> Config:
    """The ``ptdp train`` run being calibrated for: its defaults, with any flags given applied.
    ConfigError for ``--cp`` > 1: calibration measures GEMMs, memory bandwidth and the all-reduce
    at tp x pp x dp; the profile serves every cp, which it does not run."""
    cp = getattr(args, "context_parallel_size", None)
    if cp is not None and cp != 1:
        raise ConfigError(
            f"--context-parallel-size={cp}: ptdp plan --calibrate measures this machine's GEMMs, "
            "memory bandwidth and all-reduce with tp x pp x dp workers and does not run context "
            "parallelism; the profile it writes serves every cp (leave --cp out)"
        )
    model = ModelConfig()
    shape = {
        k: getattr(args, k)
        for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length")
        if getattr(args, k) is not None
    }
    model = dataclasses.replace(
        model, **shape, params_dtype="bfloat16" if plan_precision(args) == "bf16" else "float32"
    )
    train = TrainConfig()
    batch = {k: getattr(args, k) for k in ("micro_batch_size", "global_batch_size") if getattr(args, k) is not None}
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size or DEFAULT_TP,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size or DEFAULT_PP,
    )
    return resolve(
        Config(model=model, parallel=parallel, train=dataclasses.replace(train, **batch)),
        nproc if nproc is not None else calibration_workers(args),
    )


def run_calibration(args: argparse.Namespace) -> int:
    """Measure with :func:`calibration_workers` workers, write the profile, print what was fitted; 0."""
    from ptdp.run.launch import launch_workers

    nproc = calibration_workers(args)
    config = calibration_config(args, nproc)
    precision = plan_precision(args) or "fp32"
    out = Path(args.hardware_profile) if args.hardware_profile else default_profile_path()
    p = config.parallel
    print(
        f"calibrating with {nproc} workers, tp={p.tp} pp={p.pp} dp={p.dp}, {precision}, "
        f"GEMMs of a {config.model.num_layers}-layer h={config.model.hidden_size} GPT ...",
        flush=True,
    )
    result = launch_workers(calibrate_worker, nproc, config.to_json(), precision, str(out))
    gpu, constants = result["gpu"], result["constants"]
    print(
        f"peak {precision}: {gpu['peak_flops'][precision] / 1e9:.2f} GFLOP/s per worker "
        f"(GEMM half-dim {constants['gemm_half_dim']:.1f}); memory bandwidth "
        f"{gpu['memory_bandwidth'] / 1e9:.2f} GB/s per worker; all-reduce {gpu['nvlink_bandwidth'] / 1e9:.3f} GB/s, "
        f"latency {1e6 * constants['nvlink_latency']:.0f} us per ring step"
    )
    print(
        f"MoE: all-to-all at {constants['moe_exchange_efficiency']:.2f} of that bandwidth, experts' "
        f"grouped GEMM at {constants['moe_grouped_gemm_efficiency']:.2f} of the GEMM roofline"
    )
    print(
        f"profile written to {out}; `ptdp train` uses it to predict its step time, "
        f"`ptdp plan --hardware-profile {out}` plans with it"
    )
    return 0
