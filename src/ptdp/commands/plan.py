"""``ptdp plan``: parse the flags, build the request (:mod:`ptdp.planner.request`), search, print."""

from __future__ import annotations

import argparse
import sys

from ptdp.planner.report.render import json_report, plot, text_report
from ptdp.planner.request import prepare

PLAN_DESCRIPTION = """\
Predict memory and step time of every tensor x context x pipeline x data parallel layout (with
micro batch, interleaving, recompute, sequence parallelism, data-parallel sharding) of a model on a
GPU cluster;
rank them and say why the others do not fit. Example:
  ptdp plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch-size 1536 --seq-length 2048
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ptdp.planner.inputs.plan_flags import add_plan_arguments

    parser.description, parser.formatter_class = PLAN_DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_plan_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """``ptdp plan``: ``--calibrate`` (torch workers, :mod:`ptdp.commands.calibrate`, imported only
    then), the validation table with ``--validate``, else the search; the exit code."""
    if args.calibrate and not args.validate:
        from ptdp.commands.calibrate import run_calibration

        return run_calibration(args)
    return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    """``ptdp plan``: the validation table with ``--validate``, else the search; the exit code.

    ``--calibrate`` (torch workers) is dispatched by :mod:`ptdp.cli` to
    :mod:`ptdp.commands.calibrate` before this is called.
    """
    if args.validate:
        from ptdp.commands.validate import run_validation

        return run_validation(args)
    request = prepare(args)
    result = request.search()
    if args.json:
        defaulted = args.global_batch_size is None  # records as the Python API's when the flag is given
        fields = {"global_batch_size_source": request.global_batch_source} if defaulted else {}
        print(json_report(result, top=args.top, fields=fields))
    else:
        for note in request.notes:
            print(note)
        print(
            text_report(
                request.name,
                request.model,
                request.cluster,
                result,
                top=args.top,
                explanation=request.explanation(result),
            )
        )
    if args.plot and not result.plans:
        print(f"ptdp plan: no layout fits: no plot written to {args.plot}", file=sys.stderr)
    elif args.plot:
        plot(result, args.plot, capacity_bytes=request.cluster.gpu.memory_bytes, top=args.top)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0 if result.plans else 1
