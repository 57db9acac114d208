"""``ptdp train``: check the request, prepare data and the run directory, start the local workers
(PyTorch's elastic launcher), print the summary. The flags are :mod:`ptdp.config.train_flags`."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from ptdp.config.resolve import resolve

TRAIN_DESCRIPTION = """\
Train a GPT with tensor x context x pipeline x data parallelism on local worker processes
(gloo on CPU, NCCL on GPUs), started by PyTorch's elastic launcher. With no flags:
8 workers (one per GPU on a machine with GPUs), TP=2 x PP=2 x DP=2 (dp fills the workers),
a small GPT, the Python standard library's sources as corpus. For several machines use:
torchrun --nnodes N --nproc-per-node G -m ptdp.train ...
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ptdp.config.train_flags import HelpFormatter, add_train_arguments

    parser.description, parser.formatter_class = TRAIN_DESCRIPTION, HelpFormatter
    add_train_arguments(parser, local_launch=True)


def _one_line_warnings() -> None:
    """Show warnings (e.g. skipped data files) as ``warning: ...`` lines, not source excerpts."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def _binding_plan(policy: str, nproc: int) -> str:
    """The ``--bind-cpus`` plan of the local workers as lines to print ('' for none)."""
    if policy == "none":
        return ""
    import torch

    from ptdp.topology.binding import read_node_plan

    plan = read_node_plan(policy, nproc, use_gpus=torch.cuda.is_available())
    return f"\ncpu binding ({policy}):\n  " + plan.describe().replace("\n", "\n  ")


def visible_gpus() -> int | None:
    """The GPUs the local workers can use (``torch.cuda.device_count()``), None without CUDA (a
    CPU-only torch build is told without importing torch)."""
    from ptdp.config.train_flags import cpu_only_torch

    if cpu_only_torch():
        return None
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def oversubscription(nproc: int, cores: int) -> str | None:
    """The warning for ``nproc`` CPU workers on ``cores`` cores, None when they fit."""
    if nproc <= cores:
        return None
    return (
        f"warning: {nproc} workers on {cores} CPU cores, {nproc / cores:.3g} per core: each step waits for "
        f"workers that share a core (at most {cores} worker{'s' if cores > 1 else ''} keep their own core)"
    )


def run(args: argparse.Namespace) -> int:
    """``ptdp train``: the exit code (0, or 1 when a worker failed; request errors are raised)."""
    from ptdp.config.flags import config_from_args
    from ptdp.config.train_flags import local_world_size, max_restarts
    from ptdp.run.preflight import check_request, prepare_run

    _one_line_warnings()
    gpus = visible_gpus()
    nproc = local_world_size(args, gpus)
    restarts = max_restarts(args)
    config = resolve(config_from_args(args), nproc, cuda=bool(gpus))  # --params-dtype auto: bf16 on GPUs
    if args.print_config:
        print(config.to_json())
        return 0
    p, m = config.parallel, config.model
    check_request(config, nproc)
    crowded = None if gpus else oversubscription(nproc, cpu_cores())
    if crowded:
        print(crowded, file=sys.stderr, flush=True)
    binding = _binding_plan(p.bind_cpus, nproc)  # a BindingError stops here, before any worker
    config, run_dir, data = prepare_run(config, log=lambda msg: print(msg, flush=True))
    print(
        f"ptdp train: {nproc} workers, tp={p.tp}{f' cp={p.cp}' if p.cp > 1 else ''} pp={p.pp} dp={p.dp}, "
        f"{config.num_microbatches} microbatches of {config.train.micro_batch_size} per step; "
        f"{m.family} {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"seq {m.seq_length}, vocab {data.vocab_size}{_moe_summary(config)}\n"
        f"data: {data.num_train_tokens:,} train / {data.num_valid_tokens:,} validation tokens\n"
        f"run directory: {run_dir}" + binding,
        flush=True,
    )
    from ptdp.run.launch import launch_local  # torch's elastic launcher: imported once the request is good
    from ptdp.run.metrics import format_summary

    summary = launch_local(
        config, nproc, str(run_dir), str(data.cache_dir), progress=not args.no_progress, max_restarts=restarts
    )
    if "error" in summary:
        print(f"ptdp train: error: {summary['error']}\n  run directory: {run_dir}", file=sys.stderr, flush=True)
        return 1
    print(format_summary(summary, run_dir), flush=True)
    return 0


def _moe_summary(config) -> str:
    """The start line's mixture-of-experts part: experts, top-k, MoE layers, the expert grid."""
    moe, p = config.moe, config.parallel
    if not moe.enabled:
        return ""
    layers = sum(moe.moe_layers(config.model.num_layers))
    grid = "".join(f" {name}={size}" for name, size in (("ep", p.ep), ("etp", p.etp)) if size > 1)
    return f"; MoE {moe.num_experts} experts, top-{moe.moe_router_topk}, {layers} MoE layers{grid}"
