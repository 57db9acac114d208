"""``ptdp`` command line: parses flags and dispatches; no training logic lives here."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from ptdp.args import (HelpFormatter, add_train_arguments, config_from_args, local_world_size, max_restarts,
                       reject_unknown)
from ptdp.config import ConfigError, resolve
from ptdp.data import DataError
from ptdp.memory_check import check_memory
from ptdp.metrics import format_summary
from ptdp.planner.hardware import UnknownGPUError
from ptdp.planner.models import UnknownModelError
from ptdp.topology.model import TopologyError
from torch.distributed.elastic.multiprocessing.api import SignalException

TRAIN_DESCRIPTION = """\
Train a GPT with tensor x pipeline x data parallelism on local worker processes
(gloo on CPU, NCCL on GPUs), started by PyTorch's elastic launcher. With no flags:
8 workers, TP=2 x PP=2 x DP=2, a small GPT, the Python standard library's sources as
corpus. For several machines use: torchrun --nnodes N --nproc-per-node G -m ptdp.train ...
"""


PLAN_DESCRIPTION = """\
Predict memory and step time of every tensor x pipeline x data parallel layout (with micro batch,
interleaving, recompute, sequence parallelism, distributed optimizer) of a model on a GPU cluster;
rank them and say why the others do not fit. Example:
  ptdp plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch-size 1536 --seq-length 2048
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptdp", description="PTD-P GPT training on torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a GPT on local workers", description=TRAIN_DESCRIPTION,
                           formatter_class=HelpFormatter)
    add_train_arguments(train, local_launch=True)
    train.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    train.set_defaults(func=cmd_train)

    from ptdp.planner.args import add_plan_arguments

    plan = sub.add_parser("plan", help="choose a parallel layout for a model on a GPU cluster, and explain why",
                          description=PLAN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(plan)
    plan.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    plan.set_defaults(func=cmd_plan)

    from ptdp.topology.command import DESCRIPTION as TOPO_DESCRIPTION, add_topo_arguments

    topo = sub.add_parser("topo", help="show this node's GPUs, links and NUMA nodes, and place ranks on them",
                          description=TOPO_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_topo_arguments(topo)
    topo.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    topo.set_defaults(func=cmd_topo)

    gen = sub.add_parser("generate", help="continue a prompt with a trained checkpoint (any layout)",
                         formatter_class=HelpFormatter)
    gen.add_argument("--load", required=True, metavar="DIR", help="checkpoint root or iteration folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    gen.add_argument("--top-k", type=int, default=None,
                     help="with --temperature > 0: sample among the K most likely tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: the checkpoint's)")
    gen.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="export a checkpoint to Hugging Face GPT-2 or Llama, or import one",
                          formatter_class=HelpFormatter)
    conv.add_argument("direction", choices=("to-hf", "from-hf"),
                      help="to-hf: ptdp checkpoint -> GPT-2 folder (Llama with RMSNorm, --swiglu and rope); "
                           "from-hf: GPT-2 or Llama folder -> ptdp checkpoint")
    conv.add_argument("source", help="checkpoint root/iteration folder (to-hf) or GPT-2/Llama folder (from-hf)")
    conv.add_argument("target", help="GPT-2/Llama folder to write (to-hf) or checkpoint root to write (from-hf)")
    conv.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    conv.set_defaults(func=cmd_convert)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    import math

    from ptdp.generate import context_note, generate, load_for_inference, load_tokenizer

    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k={args.top_k} must be >= 1")
    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    model, meta, folder = load_for_inference(args.load)
    tokenizer = load_tokenizer(folder, args.tokenizer)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens")
    note = context_note(len(prompt), args.max_new_tokens, model.cfg.seq_length)
    if note:
        print(note, file=sys.stderr, flush=True)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed)
    print(tokenizer.decode(out), flush=True)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ptdp.checkpoint.hf import export_hf, import_hf

    if args.direction == "to-hf":
        print(f"wrote {export_hf(args.source, args.target)} (config.json, model.safetensors)")
    else:
        print(f"wrote {import_hf(args.source, args.target)}; load it with --load {args.target}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ptdp.planner.command import run

    return run(args)


def cmd_topo(args: argparse.Namespace) -> int:
    from ptdp.topology.command import run

    return run(args)


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


def cmd_train(args: argparse.Namespace) -> int:
    from ptdp.launch import launch_local
    from ptdp.rundir import check_run_dir, make_run_dir, prepare, run_dir_path, write_config

    _one_line_warnings()
    nproc = local_world_size(args)
    restarts = max_restarts(args)
    config = resolve(config_from_args(args), nproc)
    p, m = config.parallel, config.model
    if not args.force:
        check_memory(config, nproc)
    binding = _binding_plan(p.bind_cpus, nproc)  # a BindingError stops here, before any worker
    run_dir = run_dir_path(config)
    check_run_dir(run_dir, overwrite=args.overwrite, load=config.checkpoint.load)
    data = prepare(config, log=lambda msg: print(msg, flush=True))
    make_run_dir(run_dir, overwrite=args.overwrite, load=config.checkpoint.load)
    config = dataclasses.replace(config, output_dir=str(run_dir))
    write_config(run_dir, config, data)
    print(
        f"ptdp train: {nproc} workers, tp={p.tp} pp={p.pp} dp={p.dp}, "
        f"{config.num_microbatches} microbatches of {config.train.micro_batch_size} per step; "
        f"GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"seq {m.seq_length}, vocab {data.vocab_size}\n"
        f"data: {data.num_train_tokens:,} train / {data.num_valid_tokens:,} validation tokens\n"
        f"run directory: {run_dir}" + binding,
        flush=True,
    )
    summary = launch_local(config, nproc, str(run_dir), str(data.cache_dir), progress=not args.no_progress,
                           max_restarts=restarts)
    if "error" in summary:
        print(f"ptdp train: error: {summary['error']}\n  run directory: {run_dir}", file=sys.stderr, flush=True)
        return 1
    print(format_summary(summary, run_dir), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage and the closest flags, not the top-level usage
        command = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
        reject_unknown(command.choices[args.command], extra)
    try:
        return args.func(args)
    except (ConfigError, DataError, UnknownGPUError, UnknownModelError, TopologyError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SignalException):
        print(f"ptdp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failed worker: the launcher's ChildFailedError names rank and error
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: failed: {type(e).__name__}: {e}\n  (--debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
