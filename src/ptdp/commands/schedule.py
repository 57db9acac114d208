"""``ptdp schedule``: print each pipeline rank's program (its forwards, backwards or B and W, and
point-to-point groups, exactly as the runtime posts them on NCCL) and the bubble, as text, JSON or a
picture; with measured F, B, W and p2p times, the bubble rate they give (Qi et al.,
arXiv:2401.10241).

Examples::

    ptdp schedule --pipeline-schedule 1f1b --pp 4 --num-microbatches 8
    ptdp schedule --pipeline-schedule interleaved-1f1b --pp 4 --num-microbatches 8 \\
        --virtual-pipeline-stages 2 --json
    ptdp schedule --pipeline-schedule zb-h1 --pp 8 -m 24 --time-forward 18.522 \\
        --time-backward-input 18.086 --time-backward-weight 9.337 --time-p2p 0.601
    ptdp schedule --pp 4 --num-microbatches 8 --plot schedule.png
"""

from __future__ import annotations

import argparse
import json

from ptdp.errors import ConfigError

DESCRIPTION = """\
Print each pipeline rank's program: its forwards, backwards (whole, or B and W apart) and groups of
point-to-point operations, each group one batch_isend_irecv on the pipeline group's NCCL
communicator, in the order the runtime posts them; every send carries the same tag as the receive it
meets. The programs are checked deadlock-free under NCCL's rules (groups in order per communicator,
a send completes only while its receive runs) before they are printed. The bubble: the kind's
formula with F = B = W (Narayanan et al. SC21, §2.2; Qi et al. arXiv:2401.10241), and simulated as
Qi et al. define it, (span - m (F + B + W)) / span, with the --time-* flags' times (default F = B =
W, p2p free). Examples:
  ptdp schedule --pipeline-schedule 1f1b --pp 4 --num-microbatches 8
  ptdp schedule --pipeline-schedule interleaved-1f1b --pp 4 --num-microbatches 8 --virtual-pipeline-stages 2 --json
  ptdp schedule --pipeline-schedule zb-h1 --pp 8 -m 24 --time-forward 18.522 --time-backward-input 18.086 \\
      --time-backward-weight 9.337 --time-p2p 0.601
  ptdp schedule --pipeline-schedule auto --pp 4 -m 16 --memory-limit 7 --plot auto.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ptdp.config.flags import add_named_flags

    parser.description, parser.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_named_flags(
        parser,
        {
            "pipeline_schedule": "1f1b",
            "pipeline_model_parallel_size": None,
            "virtual_pipeline_model_parallel_size": None,
        },
        {
            "pipeline_schedule": "pipeline schedule (default: 1f1b)",
            "pipeline_model_parallel_size": "pipeline ranks p (default: the --times-from plan's, else 2)",
            "virtual_pipeline_model_parallel_size": "model chunks per rank (default: 2 for interleaved-1f1b, "
            "zb-v and dualpipev, else 1)",
        },
    )
    parser.add_argument(
        "--num-microbatches",
        "-m",
        type=int,
        metavar="M",
        help="microbatches per step and data-parallel rank (default: the --times-from plan's, else 8)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"ranks": [{"rank", "program", "p2p_groups"}], ...} instead of text'
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the simulated timeline of every rank")
    times = parser.add_argument_group("times for the simulated bubble (and the auto schedule), one rank's layers")
    for flag, what in (
        ("--time-forward", "a forward F"),
        ("--time-backward-input", "the input-gradient pass B"),
        ("--time-backward-weight", "the weight-gradient pass W"),
    ):
        times.add_argument(flag, type=float, metavar="MS", help=f"{what} of one microbatch (default: all three 1)")
    times.add_argument(
        "--time-p2p", type=float, metavar="MS", help="one point-to-point transfer between ranks (default: 0)"
    )
    times.add_argument(
        "--times-from",
        metavar="PLAN.json",
        help="the four times, pp and m of the best plan of a `ptdp plan --json` output (its pass_times_s: the "
        "planner's, or a calibration's with ptdp plan --hardware-profile), instead of the --time-* flags",
    )
    times.add_argument(
        "--memory-limit",
        type=int,
        metavar="M",
        help="auto only: microbatches of activations a rank may hold, each from its forward to its W "
        "(default: pp, the 1F1B peak)",
    )


#: Largest pp x v x m ``ptdp schedule`` builds, proves and prints (e.g. pp 64, m 1024); bounds its CPU time.
MAX_COMPUTES = 65_536


def run(args: argparse.Namespace) -> int:
    from ptdp.layout.pipeline.placement import V_SCHEDULES, placement_of
    from ptdp.layout.pipeline.program import build_programs, describe, program_json
    from ptdp.layout.pipeline.schedule import build_schedule
    from ptdp.layout.pipeline.timing import bubble_formula, simulate_times
    from ptdp.layout.pipeline.verify import check_schedule, in_flight_bound, simulate

    kind, p, m = args.pipeline_schedule, args.pipeline_model_parallel_size, args.num_microbatches
    v = args.virtual_pipeline_model_parallel_size
    if v is None:
        v = 2 if kind == "interleaved-1f1b" or kind in V_SCHEDULES else 1
    if args.times_from is not None:
        times, p, m = _plan_times(args)
        measured = True
    else:
        times, measured = _times(args)
        p, m = 2 if p is None else p, 8 if m is None else m
    if args.memory_limit is not None and kind != "auto":
        raise ConfigError(f"--memory-limit {args.memory_limit} is the auto schedule's; --pipeline-schedule is {kind}")
    if args.plot is not None:
        _check_plot_path(args.plot)
    if p * m * v > MAX_COMPUTES:
        raise ConfigError(
            f"pp x virtual stages x num_microbatches = {p} x {v} x {m} = {p * m * v:,}: ptdp schedule proves "
            f"and prints every compute and transfer of every rank and takes at most {MAX_COMPUTES:,} "
            f"(about 20 s of CPU); training runs check their own shape without this limit"
        )
    placement, limit = placement_of(kind), args.memory_limit
    try:
        schedule = build_schedule(kind, p, m, v, times=times, memory_limit=limit)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    bounds = [in_flight_bound(kind, p, m, v, r, limit) for r in range(p)]
    check_schedule(schedule, m, virtual_stages=v, max_in_flight=bounds, placement=placement)
    programs = build_programs(kind, p, m, v, times=times if kind == "auto" else None, memory_limit=limit)
    per_rank = simulate(schedule, virtual_stages=v, placement=placement)
    run_ = simulate_times(schedule, times, virtual_stages=v, placement=placement)
    formula, ideal = bubble_formula(kind, p, m, v)
    shares = [idle / busy for idle, busy in zip(per_rank.idle, per_rank.busy)]
    longest = max(range(p), key=run_.spans.__getitem__)
    bubble = {
        "ideal": ideal,
        "formula": formula,
        "simulated": run_.bubble_rate,
        "span": run_.spans[longest],
        "times": {
            "forward": times.forward,
            "backward_input": times.backward_input,
            "backward_weight": times.backward_weight,
            "p2p": times.p2p,
        },
        "per_rank": shares,
    }
    if args.plot:
        _plot(run_, args.plot, f"{kind}, pp={p}, m={m}, v={v}", "ms" if measured else None)
    if args.json:
        out = {
            "pipeline_schedule": kind,
            "pp": p,
            "num_microbatches": m,
            "virtual_pipeline_stages": v,
            "placement": placement,
            "bubble": bubble,
            "nccl_deadlock_free": True,
            **program_json(programs),
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"{kind}: pp={p}, num_microbatches={m}, virtual stages per rank={v}, placement {placement}")
    if ideal is None:
        print(f"bubble with F = B = W: {formula}, none at m = {m}; the simulated rate below")
    else:
        print(f"bubble: {formula} = {ideal:.4f} of the ideal time with F = B = W")
    t = times
    print(
        f"simulated: (span - m (F + B + W)) / span = {run_.bubble_rate:.4f} with F {t.forward:g}, B "
        f"{t.backward_input:g}, W {t.backward_weight:g}, p2p {t.p2p:g} (span {run_.spans[longest]:.4g} "
        f"{'ms' if measured else 'x F'} on rank {longest})"
    )
    print(
        "per rank, idle / busy with F = B = W (a whole backward 2): "
        + ", ".join(f"rank {r} {b:.4f}" for r, b in enumerate(shares))
    )
    print(
        "deadlock-free under NCCL's rules (ordered groups on communicator 'pp', rendezvous); "
        "p2p = one batch_isend_irecv; a hand-over moves a tensor between two chunks of one rank"
    )
    for r, program in enumerate(programs):
        print(f"\nrank {r}:")
        for step in program:
            print("  " + describe(step))
    if args.plot:
        print(f"\ntimeline: {args.plot}")
    return 0


def _times(args: argparse.Namespace):
    """The F, B, W and p2p times the flags give (all three passes or none; p2p 0 unless given),
    and whether they were given."""
    import math

    from ptdp.layout.pipeline.timing import StageTimes

    passes = {
        "--time-forward": args.time_forward,
        "--time-backward-input": args.time_backward_input,
        "--time-backward-weight": args.time_backward_weight,
    }
    given = {flag: t for flag, t in passes.items() if t is not None}
    if given and len(given) < len(passes):
        missing = ", ".join(flag for flag in passes if flag not in given)
        raise ConfigError(f"{', '.join(given)} given without {missing}: give the three pass times together")
    for flag, t in (*given.items(), ("--time-p2p", args.time_p2p)):
        least = 0 if flag == "--time-p2p" else None
        if t is not None and (not math.isfinite(t) or t < 0 or (least is None and t == 0)):
            rule = ">= 0" if least == 0 else "> 0"
            raise ConfigError(f"{flag} {t}: a time must be a finite number {rule}")
    p2p = args.time_p2p or 0.0
    if not given:
        return StageTimes(p2p=p2p), False
    return StageTimes(args.time_forward, args.time_backward_input, args.time_backward_weight, p2p), True


def _plan_times(args: argparse.Namespace):
    """(times in ms, pp, m) of the first fitting plan with a pipeline in the ``ptdp plan --json``
    output ``args.times_from`` (:attr:`ptdp.planner.candidate.Plan.passes`); ``--pp`` must be the
    plan's (its times are one rank's layers at that pp), ``-m`` may differ. ConfigError otherwise."""
    import math
    from pathlib import Path

    from ptdp.layout.pipeline.timing import StageTimes

    path = args.times_from
    given = [
        f
        for f, t in (
            ("--time-forward", args.time_forward),
            ("--time-backward-input", args.time_backward_input),
            ("--time-backward-weight", args.time_backward_weight),
            ("--time-p2p", args.time_p2p),
        )
        if t is not None
    ]
    if given:
        raise ConfigError(f"--times-from {path} and {', '.join(given)}: give the times one way")
    try:
        records = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"--times-from {path}: cannot read it ({err.strerror})") from None
    except ValueError:
        raise ConfigError(f"--times-from {path}: not JSON; give what `ptdp plan --json` prints") from None
    records = records if isinstance(records, list) else [records]
    plans = [r for r in records if isinstance(r, dict) and r.get("fits") and r.get("pass_times_s")]
    if not plans:
        raise ConfigError(
            f"--times-from {path}: no fitting plan with pipeline pass times (pass_times_s); a plan has them "
            "when its pp > 1 (e.g. ptdp plan ... --pp 8 --json)"
        )
    best = plans[0]
    fields = {"pp": best.get("pp"), "micro_batch_size": best.get("micro_batch_size"), "dp": best.get("dp")}
    fields |= {"global_batch_size": best.get("global_batch_size")}
    bad = [f"{k} {v!r}" for k, v in fields.items() if type(v) is not int or v < 1]
    times = best["pass_times_s"] if isinstance(best["pass_times_s"], dict) else {}
    names = ("forward", "backward_input", "backward_weight", "p2p")
    bad += [f"pass_times_s.{k} {times.get(k)!r}" for k in names if not _is_number(times.get(k))]
    if bad:
        raise ConfigError(
            f"--times-from {path}: the best plan has {', '.join(bad)}: give what `ptdp plan --json` prints "
            "(pp, micro_batch_size, dp, global_batch_size positive integers; pass times numbers)"
        )
    passes = {k: 1e3 * float(times[k]) for k in names}
    pp, m = int(best["pp"]), int(best["global_batch_size"]) // (int(best["micro_batch_size"]) * int(best["dp"]))
    if not all(math.isfinite(t) for t in passes.values()) or min(passes.values()) < 0 or m < 1:
        raise ConfigError(f"--times-from {path}: pass times {passes} ms and m {m}: times finite and >= 0, m >= 1")
    if min(passes["forward"], passes["backward_input"], passes["backward_weight"]) <= 0:
        raise ConfigError(f"--times-from {path}: pass times {passes} ms: F, B and W must be > 0")
    if args.pipeline_model_parallel_size not in (None, pp):
        raise ConfigError(
            f"--pp {args.pipeline_model_parallel_size} with --times-from {path}: its times are one rank's layers at "
            f"pp {pp}; leave --pp out or plan at pp {args.pipeline_model_parallel_size}"
        )
    m = m if args.num_microbatches is None else args.num_microbatches
    return StageTimes(passes["forward"], passes["backward_input"], passes["backward_weight"], passes["p2p"]), pp, m


def _is_number(value) -> bool:
    return type(value) in (int, float)


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


#: bar colours of the plot: forward light, whole backward dark, B and W apart
COLOURS = {"forward": "#9ecae1", "backward": "#3182bd", "backward_input": "#fd8d3c", "backward_weight": "#74c476"}


def _plot(run, path: str, title: str, unit: str | None) -> None:
    """Each rank's simulated computes as bars (:data:`COLOURS`), labelled with the microbatch (and
    chunk when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = len(run.events)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * max(len(e) for e in run.events)), 0.6 * p + 1.6))
    chunks = max((a.chunk for events in run.events for a, _, _ in events), default=0) + 1
    for r, events in enumerate(run.events):
        for a, start, end in events:
            ax.barh(r, end - start, left=start, color=COLOURS[a.kind], edgecolor="white")
            label = f"{a.microbatch}" + (f".{a.chunk}" if chunks > 1 else "")
            ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=7)
    shown = {a.kind for events in run.events for a, _, _ in events}
    names = {"forward": "F", "backward": "backward (B + W)", "backward_input": "B", "backward_weight": "W"}
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=names[k]) for k in COLOURS if k in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
        ncol=4,
        fontsize=8,
    )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})" if unit else "time (one forward of a whole stage = 1)")
    ax.set_title(f"{title}: bubble {run.bubble_rate:.4f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
