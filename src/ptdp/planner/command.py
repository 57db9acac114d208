"""``ptdp plan``: build the model and cluster from flags, search, print."""

from __future__ import annotations

import argparse
import dataclasses

from ptdp.config import ConfigError
from ptdp.planner.hardware import CATALOG, Cluster, GiB, get_gpu, load_catalog
from ptdp.planner.models import ModelSpec, get_model
from ptdp.planner.report import json_report, plot, text_report
from ptdp.planner.perf import DEFAULT_CONSTANTS
from ptdp.planner.search import Fixed, search

_SHAPE_FLAGS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size", "vocab_size": "vocab_size", "seq_length": "seq_length",
    "num_query_groups": "num_query_groups",
}


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The preset named by ``--model`` with any shape flags applied, or a model from the flags alone."""
    overrides = {field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.swiglu:
        overrides["swiglu"] = True
    if args.untie_embeddings_and_output_weights:
        overrides["tied"] = False
    if args.model:
        return dataclasses.replace(get_model(args.model), **overrides)
    missing = [f"--{f.replace('_', '-')}" for f in ("num_layers", "hidden_size", "num_attention_heads")
               if f not in overrides]
    if missing:
        raise ConfigError(f"give --model NAME or the model shape: missing {', '.join(missing)}")
    return ModelSpec(**overrides, name="custom")


def _hardware(args: argparse.Namespace):
    """The GPU and performance constants: a calibrated profile, or a catalog GPU with the defaults."""
    if args.hardware_profile:
        from ptdp.planner.calibrate import load_profile

        try:
            return load_profile(args.hardware_profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    catalog = load_catalog(args.gpu_catalog) if args.gpu_catalog else CATALOG
    return get_gpu(args.gpu, catalog), DEFAULT_CONSTANTS


def fixed_from_args(args: argparse.Namespace) -> Fixed:
    return Fixed(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, dp=args.data_parallel_size,
        micro_batch_size=args.micro_batch_size, virtual_stages=args.virtual_pipeline_stages,
        layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
        recompute=args.recompute_granularity, sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.use_distributed_optimizer,
    )


def run(args: argparse.Namespace) -> int:
    if args.validate:
        from ptdp.planner.validate_command import run_validation

        return run_validation(args)
    if args.calibrate:
        from ptdp.planner.calibrate_command import run_calibration

        return run_calibration(args)
    if args.gpus is None or args.global_batch_size is None:
        raise ConfigError("ptdp plan needs --gpus N and --global-batch-size B (or --validate CSV, or --calibrate)")
    gpu, constants = _hardware(args)
    try:
        cluster = Cluster(gpu, args.gpus, args.gpus_per_node or gpu.gpus_per_node)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model = model_from_args(args)
    overhead = None if args.memory_overhead_gib is None else args.memory_overhead_gib * GiB
    precision = args.precision or ("bf16" if "bf16" in gpu.peak_flops else sorted(gpu.peak_flops)[0])
    if precision not in gpu.peak_flops:
        raise ConfigError(f"{gpu.name} has no peak FLOP/s for {precision}; known: {sorted(gpu.peak_flops)}")
    result = search(model, cluster, args.global_batch_size, fixed=fixed_from_args(args),
                    precision=precision, constants=constants, overhead_bytes=overhead)
    if args.json:
        print(json_report(result, top=args.top))
    else:
        print(text_report(model, cluster, result, top=args.top))
    if args.plot:
        plot(result, args.plot, capacity_bytes=gpu.memory_bytes, top=min(args.top, 8))
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0 if result.plans else 1
