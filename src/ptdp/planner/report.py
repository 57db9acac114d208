"""Human-readable and JSON reports of a search, and the breakdown plot."""

from __future__ import annotations

import json
from collections import defaultdict

from ptdp.planner.hardware import Cluster, GiB
from ptdp.planner.models import ModelSpec
from ptdp.planner.plan import Plan
from ptdp.planner.rules import Rejection
from ptdp.planner.search import SearchResult

_MEM = ("params", "grads", "optimizer", "activations", "overhead")
_TIME = ("compute", "recompute", "tp_comm", "pp_comm", "bubble", "dp_comm", "optimizer")


def _layout_cells(plan: Plan) -> list[str]:
    lay = plan.layout
    return [str(lay.tp), str(lay.pp), str(lay.dp), str(lay.micro_batch_size), str(lay.virtual_stages),
            lay.recompute, "y" if lay.sequence_parallel else "n", "y" if lay.distributed_optimizer else "n"]


def _num(x: float) -> str:
    """3 decimals for values >= 1, else 3 significant digits (tiny models stay readable)."""
    return f"{x:.3f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def _row(plan: Plan, rank: int, capacity: float) -> list[str]:
    mem, t = plan.memory, plan.time
    cells = [str(rank)] + _layout_cells(plan)
    cells += [_num(getattr(mem, k) / GiB) for k in _MEM] + [f"{_num(mem.total / GiB)}/{_num(capacity / GiB)}"]
    cells += [_num(getattr(t, k)) for k in _TIME] + [_num(t.step)]
    cells += [_num(plan.tflops_per_gpu / 1e12), f"{100 * plan.mfu:.1f}%"]
    return cells


HEADER = (["#", "tp", "pp", "dp", "b", "v", "recomp", "sp", "dopt"]
          + ["params", "grads", "optim", "activ", "overh", "total/cap GiB"]
          + ["compute", "recomp", "tp_comm", "pp_comm", "bubble", "dp_comm", "optim", "step s"]
          + ["TFLOP/s", "MFU"])


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def text_report(model: ModelSpec, cluster: Cluster, result: SearchResult, *, top: int = 10) -> str:
    """Ranked table of the ``top`` fitting layouts and a summary of why the others were rejected."""
    gpu = cluster.gpu
    lines = [
        f"model {model.name}: l={model.num_layers} h={model.hidden_size} a={model.num_attention_heads} "
        f"ffn={model.ffn} V={model.vocab_size} s={model.seq_length}; {cluster.num_gpus} x {gpu.name} "
        f"({cluster.gpus_per_node} per node); {result.evaluated:,} layouts, {len(result.plans):,} fit",
        "memory in GiB on the most loaded GPU; time in seconds per step; TFLOP/s per GPU = FLOPs executed "
        "(with full recompute Narayanan et al. eq. 3; with selective the recomputed attention added) / step time; "
        "MFU = model FLOPs / (step time x peak)",
        "",
    ]
    if result.plans:
        rows = [_row(p, i + 1, gpu.memory_bytes) for i, p in enumerate(result.plans[:top])]
        lines.append(_table(rows, HEADER))
        best = result.plans[0]
        lines += ["", f"best: {_describe(best)}: {_num(best.time.step)} s/step, "
                      f"{_num(best.tflops_per_gpu / 1e12)} TFLOP/s per GPU, MFU {100 * best.mfu:.1f}%"]
    else:
        lines.append("no layout fits.")
    lines += ["", *rejection_summary(result)]
    return "\n".join(lines)


def _describe(plan: Plan) -> str:
    lay = plan.layout
    return (f"tp={lay.tp} pp={lay.pp} dp={lay.dp} b={lay.micro_batch_size} v={lay.virtual_stages} "
            f"recompute={lay.recompute} sp={'on' if lay.sequence_parallel else 'off'} "
            f"dist-opt={'on' if lay.distributed_optimizer else 'off'}")


def grouped_rejections(result: SearchResult) -> dict[str, list[tuple[Plan, Rejection]]]:
    groups: dict[str, list[tuple[Plan, Rejection]]] = defaultdict(list)
    for plan, rejection in result.rejected:
        groups[rejection.rule].append((plan, rejection))
    return groups


def representatives(result: SearchResult, per_rule: int = 3) -> list[Plan]:
    """A few rejected plans per rule: for memory the closest to fitting, else distinct messages."""
    out = []
    for rule, items in sorted(grouped_rejections(result).items()):
        if rule == "memory":
            items = sorted(items, key=lambda it: it[0].memory.total)
        seen = set()
        for plan, rejection in items:
            if rejection.message not in seen:
                seen.add(rejection.message)
                out.append(plan)
            if len(seen) == per_rule:
                break
    return out


def rejection_summary(result: SearchResult, per_rule: int = 3) -> list[str]:
    groups = grouped_rejections(result)
    if not groups:
        return ["rejected: none"]
    lines = [f"rejected: {len(result.rejected):,} layouts"]
    for rule, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {rule}: {len(items):,} layouts, e.g.")
        reps = [p for p in representatives(SearchResult([], items), per_rule)]
        for plan in reps:
            lines.append(f"    {_describe(plan)}: {plan.reasons[0]}")
    return lines


def json_report(result: SearchResult, *, top: int = 10) -> str:
    """The plans of :func:`text_report` as a JSON list: the top fitting plans, then a few rejected
    ones per rule (``fits`` false, ``reasons`` saying why)."""
    plans = result.plans[:top] + representatives(result)
    return json.dumps([p.to_json() for p in plans], indent=2)


def plot(result: SearchResult, path: str, *, capacity_bytes: float, top: int = 8) -> None:
    """Stacked bars of the memory (GiB, with the GPU's capacity dashed) and step-time (s)
    breakdown of the ``top`` layouts, saved as an image at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = result.plans[:top]
    if not plans:
        raise ValueError("no layout fits: nothing to plot")
    labels = [f"#{i + 1} tp{p.layout.tp} pp{p.layout.pp} dp{p.layout.dp} b{p.layout.micro_batch_size} "
              f"v{p.layout.virtual_stages} {p.layout.recompute[:3]}{' sp' if p.layout.sequence_parallel else ''}"
              f"{' do' if p.layout.distributed_optimizer else ''}" for i, p in enumerate(plans)]
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(plans)), 5))
    for ax, keys, get, unit in ((ax_m, _MEM, lambda p, k: getattr(p.memory, k) / GiB, "GiB"),
                                (ax_t, _TIME, lambda p, k: getattr(p.time, k), "s")):
        bottom = [0.0] * len(plans)
        for key in keys:
            values = [get(p, key) for p in plans]
            ax.bar(range(len(plans)), values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(plans)), labels, fontsize=7, rotation=35, ha="right")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    ax_m.axhline(capacity_bytes / GiB, color="k", ls="--", lw=1, label="capacity")
    ax_m.set_title("memory on the most loaded GPU")
    ax_t.set_title("step time breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
