"""``ptdp schedule``: print each pipeline rank's program (its forwards, backwards and point-to-point
groups, exactly as the runtime posts them on NCCL) and the bubble, as text, JSON or a picture.

Examples::

    ptdp schedule --pipeline-schedule 1f1b --pp 4 --num-microbatches 8
    ptdp schedule --pipeline-schedule interleaved-1f1b --pp 4 --num-microbatches 8 \\
        --virtual-pipeline-stages 2 --json
    ptdp schedule --pp 4 --num-microbatches 8 --plot schedule.png
"""

from __future__ import annotations

import argparse
import json

from ptdp.errors import ConfigError

DESCRIPTION = """\
Print each pipeline rank's program: its forwards (F), backwards (B) and groups of point-to-point
operations, each group one batch_isend_irecv on the pipeline group's NCCL communicator, in the order
the runtime posts them; every send carries the same tag as the receive it meets. The programs are
checked deadlock-free under NCCL's rules (groups in order per communicator, a send completes only
while its receive runs) before they are printed. The bubble: (p - 1) / (v m) of the ideal time
(Narayanan et al. SC21, §2.2), and as simulated with a backward twice a forward. Examples:
  ptdp schedule --pipeline-schedule 1f1b --pp 4 --num-microbatches 8
  ptdp schedule --pipeline-schedule interleaved-1f1b --pp 4 --num-microbatches 8 --virtual-pipeline-stages 2 --json
  ptdp schedule --pp 4 --num-microbatches 8 --plot schedule.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ptdp.config.flags import add_named_flags

    parser.description, parser.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_named_flags(
        parser,
        {"pipeline_schedule": "1f1b", "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None},
        {
            "pipeline_schedule": "pipeline schedule (default: 1f1b)",
            "pipeline_model_parallel_size": "pipeline ranks p (default: 2)",
            "virtual_pipeline_model_parallel_size": "model chunks per rank for interleaved-1f1b (default: 2 for "
            "interleaved-1f1b, else 1)",
        },
    )
    parser.add_argument(
        "--num-microbatches",
        "-m",
        type=int,
        default=8,
        metavar="M",
        help="microbatches per step and data-parallel rank (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"ranks": [{"rank", "program", "p2p_groups"}], ...} instead of text'
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the simulated timeline of every rank")


#: Largest pp x v x m ``ptdp schedule`` builds, proves and prints (e.g. pp 64, m 1024); bounds its CPU time.
MAX_COMPUTES = 65_536


def run(args: argparse.Namespace) -> int:
    from ptdp.layout.pipeline.program import build_programs, describe, program_json
    from ptdp.layout.pipeline.schedule import build_schedule
    from ptdp.layout.pipeline.verify import check_schedule, in_flight_bound, simulate

    kind, p, m = args.pipeline_schedule, args.pipeline_model_parallel_size, args.num_microbatches
    v = args.virtual_pipeline_model_parallel_size
    if v is None:
        v = 2 if kind == "interleaved-1f1b" else 1
    if args.plot is not None:
        _check_plot_path(args.plot)
    if p * m * v > MAX_COMPUTES:
        raise ConfigError(
            f"pp x virtual stages x num_microbatches = {p} x {v} x {m} = {p * m * v:,}: ptdp schedule proves "
            f"and prints every compute and transfer of every rank and takes at most {MAX_COMPUTES:,} "
            f"(about 20 s of CPU); training runs check their own shape without this limit"
        )
    try:
        schedule = build_schedule(kind, p, m, v)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_schedule(schedule, m, virtual_stages=v, max_in_flight=[in_flight_bound(kind, p, m, v, r) for r in range(p)])
    programs = build_programs(kind, p, m, v)
    timeline = simulate(schedule, virtual_stages=v)
    bubble = {
        "ideal": (p - 1) / (v * m),
        "simulated": [idle / busy for idle, busy in zip(timeline.idle, timeline.busy)],
    }
    if args.plot:
        _plot(timeline, args.plot, f"{kind}, pp={p}, m={m}, v={v}")
    if args.json:
        out = {
            "pipeline_schedule": kind,
            "pp": p,
            "num_microbatches": m,
            "virtual_pipeline_stages": v,
            "bubble": bubble,
            "nccl_deadlock_free": True,
            **program_json(programs),
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"{kind}: pp={p}, num_microbatches={m}, virtual stages per rank={v}")
    print(
        f"bubble: (p - 1) / (v m) = {bubble['ideal']:.4f} of the ideal time; simulated (backward = 2 forwards): "
        + ", ".join(f"rank {r} {b:.4f}" for r, b in enumerate(bubble["simulated"]))
    )
    print(
        "deadlock-free under NCCL's rules (ordered groups on communicator 'pp', rendezvous); "
        "p2p = one batch_isend_irecv"
    )
    for r, program in enumerate(programs):
        print(f"\nrank {r}:")
        for step in program:
            print("  " + describe(step))
    if args.plot:
        print(f"\ntimeline: {args.plot}")
    return 0


def _check_plot_path(path: str) -> None:
    """ConfigError unless ``path`` names a new or existing ``.png`` file in a writable folder."""
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path!r}: the picture is a PNG file; give a name ending in .png")
    if target.is_dir():
        raise ConfigError(f"--plot {path!r} is a folder; give a file name ending in .png")
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"--plot {path!r}: the folder {str(folder)!r} does not exist")
    import os

    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot {path!r}: the folder {str(folder)!r} is not writable")


def _plot(timeline, path: str, title: str) -> None:
    """Each rank's simulated computes as bars: forwards light, backwards dark, labelled with the
    microbatch (and chunk when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = len(timeline.events)
    fig, ax = plt.subplots(figsize=(max(8.0, timeline.makespan * 0.35), 0.6 * p + 1.2))
    chunks = max((a.chunk for events in timeline.events for a, _, _ in events), default=0) + 1
    for r, events in enumerate(timeline.events):
        for a, start, end in events:
            ax.barh(
                r, end - start, left=start, color="#9ecae1" if a.kind == "forward" else "#3182bd", edgecolor="white"
            )
            label = f"{a.microbatch}" + (f".{a.chunk}" if chunks > 1 else "")
            ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (one forward of a whole stage = 1)")
    ax.set_title(f"{title}: forward (light), backward (dark)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
