"""``ptdp`` command line: parses flags and dispatches; no training logic lives here."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from ptdp.args import add_train_arguments, config_from_args, local_world_size
from ptdp.config import ConfigError, resolve
from ptdp.data import DataError

TRAIN_DESCRIPTION = """\
Train a GPT with tensor x pipeline x data parallelism on local worker processes
(gloo on CPU, NCCL on GPUs), started by PyTorch's elastic launcher. With no flags:
8 workers, TP=2 x PP=2 x DP=2, a small GPT, the Python standard library's sources as
corpus. For several machines use: torchrun --nnodes N --nproc-per-node G -m ptdp.train ...
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptdp", description="PTD-P GPT training on torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a GPT on local workers", description=TRAIN_DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(train, local_launch=True)
    train.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    train.set_defaults(func=cmd_train)
    return parser


def _one_line_warnings() -> None:
    """Show warnings (e.g. skipped data files) as ``warning: ...`` lines, not source excerpts."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=sys.stderr, flush=True)
    warnings.showwarning = show


def cmd_train(args: argparse.Namespace) -> int:
    from ptdp.launch import launch_local
    from ptdp.rundir import make_run_dir, prepare, write_config

    _one_line_warnings()
    nproc = local_world_size(args)
    config = resolve(config_from_args(args), nproc)
    p, m = config.parallel, config.model
    data = prepare(config, log=lambda msg: print(msg, flush=True))
    run_dir = make_run_dir(config, overwrite=args.overwrite)
    config = dataclasses.replace(config, output_dir=str(run_dir))
    write_config(run_dir, config, data)
    print(
        f"ptdp train: {nproc} workers, tp={p.tp} pp={p.pp} dp={p.dp}, "
        f"{config.num_microbatches} microbatches of {config.train.micro_batch_size} per step; "
        f"GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"seq {m.seq_length}, vocab {data.vocab_size}\n"
        f"data: {data.num_train_tokens:,} train / {data.num_valid_tokens:,} validation tokens\n"
        f"run directory: {run_dir}",
        flush=True,
    )
    summary = launch_local(config, nproc, str(run_dir), str(data.cache_dir), progress=not args.no_progress)
    _print_summary(summary, run_dir)
    return 0


def _print_summary(s: dict, run_dir) -> None:
    lines = [f"done: {s['iterations']} iterations in {s['elapsed_s']:.1f} s"]
    if s.get("tokens_per_s"):
        lines.append(f"  throughput: {s['tokens_per_s']:,.0f} tokens/s, {s['mean_step_time_s']:.3f} s/step")
    if s.get("final_loss") is not None:
        lines.append(f"  train loss: {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s.get("val_loss_ratio") is not None:
        lines.append(
            f"  validation loss: {s['initial_val_loss']:.4f} -> {s['final_val_loss']:.4f} "
            f"({s['val_loss_ratio']:.2f} of its start)"
        )
    lines.append(f"  run directory: {run_dir} (config.json, metrics.jsonl, summary.json)")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ptdp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failed worker: the launcher's ChildFailedError names rank and error
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
