"""``ptdp`` command line: parses flags and dispatches; no training logic lives here.

Only the chosen command's flags and code are imported: ``ptdp plan`` (search, ``--json``,
``--plot``, ``--validate``) and ``ptdp topo`` import no torch; ``train``, ``generate``, ``convert``
and ``plan --calibrate`` do.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback

from ptdp.config.flags import Parser, reject_unknown
from ptdp.errors import ConfigError
from ptdp.planner.inputs.hardware import UnknownGPUError
from ptdp.planner.inputs.models import UnknownModelError
from ptdp.topology.node import TopologyError

#: each command: its one-line help and its module (imported only when chosen), which provides
#: ``add_arguments(parser)`` and ``run(args) -> exit code``
COMMANDS = {
    "train": ("train a GPT on local workers", "ptdp.commands.train"),
    "plan": ("choose a parallel layout for a model on a GPU cluster, and explain why", "ptdp.commands.plan"),
    "schedule": (
        "print each pipeline rank's program and p2p groups, proven deadlock-free under NCCL",
        "ptdp.commands.schedule",
    ),
    "topo": ("show this node's GPUs, links and NUMA nodes, and place ranks on them", "ptdp.commands.topo"),
    "generate": ("continue a prompt with a trained checkpoint (any layout)", "ptdp.commands.generate"),
    "convert": ("export a checkpoint to Hugging Face GPT-2 or Llama, or import one", "ptdp.commands.convert"),
}


class _Version(argparse.Action):
    """``--version``: the installed version, read only when asked for."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"ptdp {version('ptdp')}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ptdp`` parser. ``command``: add only that command's flags (the others are listed by name
    and help, without importing their modules); None: every command's flags."""
    parser = Parser(prog="ptdp", description="PTD-P GPT training on torch.distributed.")
    parser.add_argument("--version", action=_Version, nargs=0, help="show ptdp's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            implementation = importlib.import_module(module)
            implementation.add_arguments(command_parser)
            command_parser.set_defaults(func=implementation.run)
            command_parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return parser


def _command_name(argv: list[str]) -> str:
    """The command named in ``argv`` (its first non-flag word; the top level has no other
    arguments), or '' for none."""
    return next((a for a in argv if not a.startswith("-")), "")


def _take_config_file(parser: argparse.ArgumentParser, name: str, argv: list[str]) -> None:
    """Set the defaults of command ``name`` from its ``--config FILE``, if it has that flag."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(name) if sub is not None else None
    if command is None or not any("--config" in a.option_strings for a in command._actions):
        return
    from ptdp.config.files import apply_config_file

    apply_config_file(command, argv[argv.index(name) + 1 :])


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors reported as one line (exit code 2). :class:`ptdp.data.DataError` counts only once
    ``ptdp.data`` is imported (before that none can be raised), so ``ptdp plan`` needs not import it."""
    errors = (ConfigError, UnknownGPUError, UnknownModelError, TopologyError)
    data_errors = sys.modules.get("ptdp.errors")
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
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        reject_unknown(command.choices[args.command], extra)
    try:
        return args.func(args)
    except _user_errors() as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"ptdp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`ptdp schedule ... | head`): not a failure of ours
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _interruptions():
        print(f"ptdp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failed worker: the launcher's ChildFailedError names rank and error
        if getattr(args, "debug", False):
            raise
        print(f"ptdp {args.command}: failed: {type(e).__name__}: {e}\n  (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
