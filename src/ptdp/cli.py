"""``ptdp`` command line: parses flags and dispatches; no training logic lives here.

Only the chosen command's flags and code are imported: ``ptdp plan`` (search, ``--json``,
``--plot``, ``--validate``) and ``ptdp topo`` import no torch; ``train``, ``generate``, ``convert``
and ``plan --calibrate`` do.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from ptdp.spec import ConfigError, resolve
from ptdp.planner.hardware import UnknownGPUError
from ptdp.planner.models import UnknownModelError
from ptdp.topology.model import TopologyError

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


def _train_flags(train: argparse.ArgumentParser) -> None:
    from ptdp.args import HelpFormatter, add_train_arguments

    train.description, train.formatter_class = TRAIN_DESCRIPTION, HelpFormatter
    add_train_arguments(train, local_launch=True)
    train.set_defaults(func=cmd_train)


def _plan_flags(plan: argparse.ArgumentParser) -> None:
    from ptdp.planner.args import add_plan_arguments

    plan.description, plan.formatter_class = PLAN_DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def _topo_flags(topo: argparse.ArgumentParser) -> None:
    from ptdp.topology.command import DESCRIPTION as TOPO_DESCRIPTION, add_topo_arguments

    topo.description, topo.formatter_class = TOPO_DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_topo_arguments(topo)
    topo.set_defaults(func=cmd_topo)


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    from ptdp.args import HelpFormatter

    gen.formatter_class = HelpFormatter
    gen.add_argument("--load", required=True, metavar="DIR", help="checkpoint root or iteration folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    gen.add_argument("--top-k", type=int, default=None,
                     help="with --temperature > 0: sample among the K most likely tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: the checkpoint's)")
    gen.set_defaults(func=cmd_generate)


def _convert_flags(conv: argparse.ArgumentParser) -> None:
    from ptdp.args import HelpFormatter

    conv.formatter_class = HelpFormatter
    conv.add_argument("direction", choices=("to-hf", "from-hf"),
                      help="to-hf: ptdp checkpoint -> GPT-2 folder (Llama with RMSNorm, --swiglu and rope); "
                           "from-hf: GPT-2 or Llama folder -> ptdp checkpoint")
    conv.add_argument("source", help="checkpoint root/iteration folder (to-hf) or GPT-2/Llama folder (from-hf)")
    conv.add_argument("target", help="GPT-2/Llama folder to write (to-hf) or checkpoint root to write (from-hf)")
    conv.set_defaults(func=cmd_convert)


#: each command: its one-line help and the function adding its flags (imported only when chosen)
COMMANDS = {
    "train": ("train a GPT on local workers", _train_flags),
    "plan": ("choose a parallel layout for a model on a GPU cluster, and explain why", _plan_flags),
    "topo": ("show this node's GPUs, links and NUMA nodes, and place ranks on them", _topo_flags),
    "generate": ("continue a prompt with a trained checkpoint (any layout)", _generate_flags),
    "convert": ("export a checkpoint to Hugging Face GPT-2 or Llama, or import one", _convert_flags),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ptdp`` parser. ``command``: add only that command's flags (the others are listed by name
    and help, without importing their modules); None: every command's flags."""
    parser = argparse.ArgumentParser(prog="ptdp", description="PTD-P GPT training on torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_flags) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            add_flags(command_parser)
            command_parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
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
    """``ptdp plan``: the planner (no torch), or with ``--calibrate`` the measuring workers."""
    if args.calibrate and not args.validate:  # torch workers: outside the planner, imported only here
        from ptdp.calibration_command import run_calibration

        return run_calibration(args)
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
    from ptdp.args import config_from_args, local_world_size, max_restarts
    from ptdp.launch import launch_local
    from ptdp.memory_check import check_memory
    from ptdp.metrics import format_summary
    from ptdp.rundir import check_run_dir, make_run_dir, prepare, run_dir_path, write_config

    _one_line_warnings()
    nproc = local_world_size(args)
    restarts = max_restarts(args)
    config = resolve(config_from_args(args), nproc)
    if args.print_config:
        print(config.to_json())
        return 0
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
        f"{m.family} {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
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


def _command_name(argv: list[str]) -> str:
    """The command named in ``argv`` (its first non-flag word; the top level has no other
    arguments), or '' for none."""
    return next((a for a in argv if not a.startswith("-")), "")


def _take_config_file(parser: argparse.ArgumentParser, name: str, argv: list[str]) -> None:
    """Set the defaults of command ``name`` from its ``--config FILE``, if it has that flag."""
    sub = next((a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(name) if sub is not None else None
    if command is None or not any("--config" in a.option_strings for a in command._actions):
        return
    from ptdp.spec.files import apply_config_file

    apply_config_file(command, argv[argv.index(name) + 1:])


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors reported as one line (exit code 2). :class:`ptdp.data.DataError` counts only once
    ``ptdp.data`` is imported (before that none can be raised), so ``ptdp plan`` needs not import it."""
    errors = (ConfigError, UnknownGPUError, UnknownModelError, TopologyError)
    data_errors = sys.modules.get("ptdp.data.errors")
    return errors + ((data_errors.DataError,) if data_errors else ())


def _interruptions() -> tuple[type[BaseException], ...]:
    """Ctrl-C, and the elastic launcher's SignalException once the launcher is imported (exit 130)."""
    api = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    return (KeyboardInterrupt,) + ((api.SignalException,) if api else ())


def main(argv: list[str] | None = None) -> int:
    """Run ``ptdp`` with ``argv`` (default: the process's arguments); the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _command_name(argv)
    parser = build_parser(name)
    try:  # --config FILE: its settings become the command's defaults, the command line overrides them
        _take_config_file(parser, name, argv)
    except ConfigError as e:
        print(f"ptdp {name}: error: {e}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage and the closest flags, not the top-level usage
        from ptdp.args import reject_unknown

        command = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
        reject_unknown(command.choices[args.command], extra)
    try:
        return args.func(args)
    except _user_errors() as e:
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _interruptions():
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
