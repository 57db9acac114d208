"""Human-readable and JSON reports of a search, and the breakdown plot."""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from ptdp.config.model import ModelConfig
from ptdp.errors import Violation
from ptdp.planner.candidate import Plan
from ptdp.planner.inputs.hardware import Cluster, GiB
from ptdp.planner.inputs.moe_model import MoEModel, moe_of
from ptdp.planner.search.layouts import SearchResult
from ptdp.planner.splits import describe_split, megatron_layout, split_report_lines

_MEM = ("params", "grads", "optimizer", "activations", "overhead")
_TIME = ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm", "optimizer")
#: the time parts of a mixture-of-experts model's plans: the exchanges and the expert-data-parallel reduction too
_MOE_TIME = (*_TIME[:5], "ep_comm", *_TIME[5:7], "edp_comm", _TIME[7])


def _layout_cells(plan: Plan, moe: bool = False) -> list[str]:
    lay = plan.layout
    experts = [str(lay.ep), str(lay.etp)] if moe else []
    return [
        *experts,
        str(lay.tp),
        str(lay.cp),
        str(lay.pp),
        str(lay.dp),
        str(lay.micro_batch_size),
        str(lay.virtual_stages),
        lay.parallel.schedule,
        lay.recompute,
        "y" if lay.parallel.sequence_parallel else "n",
        lay.sharding_strategy,
    ]


def _num(x: float) -> str:
    """3 decimals for values >= 1, else 3 significant digits (tiny models stay readable)."""
    return f"{x:.3f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def _optional(value: float | None, show: Callable[[float], str]) -> str:
    return "-" if value is None else show(value)


def _row(plan: Plan, rank: int, capacity: float, moe: bool = False) -> list[str]:
    mem, t = plan.need_memory(), plan.need_time()
    cells = [str(rank)] + _layout_cells(plan, moe)
    cells += [_num(getattr(mem, k) / GiB) for k in _MEM] + [f"{_num(mem.total / GiB)}/{_num(capacity / GiB)}"]
    cells += [_num(getattr(t, k)) for k in (_MOE_TIME if moe else _TIME)] + [_num(t.step)]
    cells += [_optional(plan.tflops_per_gpu, _num), _optional(plan.mfu, lambda mfu: f"{100 * mfu:.1f}%")]
    return cells


HEADER = (
    ["#", "tp", "cp", "pp", "dp", "b", "v", "schedule", "recomp", "sp", "shard"]
    + ["params", "grads", "optim", "activ", "overh", "total/cap GiB"]
    + ["compute", "recomp", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm", "optim", "step s"]
    + ["TFLOP/s", "MFU"]
)
MOE_HEADER = (
    ["#", "ep", "etp", *HEADER[1:17]]
    + ["compute", "recomp", "tp_comm", "cp_comm", "pp_comm", "ep_comm", "bubble", "dp_comm", "edp_comm", "optim"]
    + HEADER[-3:]
)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _fp8_words(result: SearchResult) -> str:
    """``, FP8 GEMMs`` with its recipe as ``ptdp train`` runs it (none: Transformer Engine's) when
    the plans run FP8 GEMMs, else nothing."""
    layouts = [p.layout for p in _first_plans(result) if p.layout.fp8]
    if not layouts:
        return ""
    recipe = layouts[0].fp8_recipe
    return f", FP8 GEMMs ({recipe})" if recipe else ", FP8 GEMMs"


def _first_plans(result: SearchResult) -> list[Plan]:
    """The first fitting and the first rejected plan (those that exist): what every layout of the
    search shares, such as its precision."""
    return [*result.plans[:1], *(plan for plan, _ in result.rejected[:1])]


def text_report(
    name: str,
    model: ModelConfig,
    cluster: Cluster,
    result: SearchResult,
    *,
    top: int = 10,
    explanation: Sequence[str] = (),
) -> str:
    """Ranked table of the ``top`` fitting layouts, the ``explanation`` lines of the pick
    (:mod:`ptdp.planner.report.explain`) and a summary of why the others were rejected."""
    gpu = cluster.gpu
    moe = moe_of(model)
    experts = (
        f" E={moe.num_experts} k={moe.moe_router_topk} F={moe.expert_ffn(model.ffn)}"
        + (f" shared={moe.shared_ffn}" if moe.shared_ffn else "")
        + f" ({len(model.moe_layer_ids)} MoE layers)"  # type: ignore[attr-defined]
        + (f" rho={model.load_imbalance:g}" if isinstance(model, MoEModel) and model.load_imbalance != 1.0 else "")
        + (f" capacity={moe.moe_expert_capacity_factor:g}" if moe.moe_expert_capacity_factor else "")
        + (f" mtp={model.mtp_layers}" if isinstance(model, MoEModel) and model.mtp_layers else "")
        if moe is not None
        else ""
    )
    lines = [
        f"model {name}: l={model.num_layers} h={model.hidden_size} a={model.num_attention_heads} "
        f"kv={model.kv_heads} ffn={model.ffn}{experts} V={model.vocab_size} s={model.seq_length}, "
        f"{'flash' if model.flash_attention else 'unfused'} attention"
        f"{' (keys and values repeated to every head)' if model.kv_repeated else ''}"
        f"{_fp8_words(result)}; "
        f"{cluster.num_gpus} x {gpu.name} "
        f"({cluster.gpus_per_node} per node); {result.evaluated:,} layouts, {len(result.plans):,} fit",
        "memory in GiB on the most loaded GPU; time in seconds per step; TFLOP/s per GPU = FLOPs executed "
        "(with full recompute Narayanan et al. eq. 3; with selective the recomputed attention, and the MLP's GEMMs "
        "with --recompute-modules mlp, added; with op the recomputed matmuls) / step time; "
        "MFU = model FLOPs / (step time x peak)",
        "",
    ]
    if result.plans:
        rows = [_row(p, i + 1, gpu.memory_bytes, moe is not None) for i, p in enumerate(result.plans[:top])]
        lines.append(_table(rows, HEADER if moe is None else MOE_HEADER))
        best = result.plans[0]
        lines += [
            "",
            f"best: {_describe(best)}: {_num(best.need_time().step)} s/step, "
            f"{_optional(best.tflops_per_gpu, _num)} TFLOP/s per GPU, "
            f"MFU {_optional(best.mfu, lambda mfu: f'{100 * mfu:.1f}%')}",
        ]
        mtp = model.mtp_layers if isinstance(model, MoEModel) else 0
        if mtp and best.layout.pp > 1:  # Megatron counts its MTP modules apart: only a layout string places them
            p = best.layout.parallel
            counted = (p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
            layout = megatron_layout(
                model.num_layers, mtp, best.layout.pp, best.layout.virtual_stages, best.layout.layer_split, counted
            )
            lines.append(
                f'pipeline: Megatron-LM\'s --pipeline-model-parallel-layout "{layout}" with --num-layers '
                f"{model.num_layers - mtp} --mtp-num-layers {mtp} (ptdp train does not build MTP modules)"
            )
        else:
            lines += split_report_lines(best.layout.layer_split, best.layout.virtual_stages)
        lines += pass_lines(best)
    else:
        lines.append("no layout fits.")
    if explanation:
        lines += ["", *explanation]
    notes = [f"note: {note}" for note in result.notes]
    lines += ["", *notes, *([""] if notes else []), *rejection_summary(result)]
    return "\n".join(lines)


def pass_lines(plan: Plan) -> list[str]:
    """The pipeline passes of ``plan`` (:attr:`Plan.passes`) in ms, and the ``ptdp schedule`` command
    that builds the ``auto`` schedule from them; nothing without a pipeline."""
    t, lay = plan.passes, plan.layout
    if t is None:
        return []
    ms = {k: f"{1e3 * getattr(t, k):.4g}" for k in ("forward", "backward_input", "backward_weight", "p2p")}
    return [
        f"passes of one microbatch on a middle pipeline rank: F {ms['forward']} ms, B {ms['backward_input']} ms, "
        f"W {ms['backward_weight']} ms, p2p {ms['p2p']} ms; the auto schedule from them (or --times-from the "
        f"--json output): ptdp schedule --pipeline-schedule auto --pp {lay.pp} -m {lay.num_microbatches} "
        f"--time-forward {ms['forward']} --time-backward-input {ms['backward_input']} "
        f"--time-backward-weight {ms['backward_weight']} --time-p2p {ms['p2p']}"
    ]


def _describe(plan: Plan) -> str:
    lay = plan.layout
    experts = f" ep={lay.ep}" + (f" etp={lay.etp}" if lay.etp > 1 else "") if lay.ep * lay.etp > 1 else ""
    return (
        f"tp={lay.tp}{f' cp={lay.cp}' if lay.cp > 1 else ''} pp={lay.pp} dp={lay.dp}{experts} b={lay.micro_batch_size} "
        f"v={lay.virtual_stages}{_schedule_words(lay)} recompute={lay.recompute} "
        f"sp={'on' if lay.parallel.sequence_parallel else 'off'} "
        f"sharding={lay.sharding_strategy}"
        + (
            f" layers={describe_split(lay.layer_split).replace(' x ', 'x').replace(', ', ',')}"
            if lay.layer_split
            else ""
        )
    )


def _schedule_words(layout) -> str:
    """`` schedule=KIND`` unless the layout runs the schedule its v implies (1f1b, interleaved-1f1b)."""
    kind = layout.parallel.schedule
    return "" if kind in ("1f1b", "interleaved-1f1b") else f" schedule={kind}"


def grouped_rejections(result: SearchResult) -> dict[str, list[tuple[Plan, Violation]]]:
    groups: dict[str, list[tuple[Plan, Violation]]] = defaultdict(list)
    for plan, rejection in result.rejected:
        groups[rejection.rule].append((plan, rejection))
    return groups


def representatives(result: SearchResult, per_rule: int = 3) -> list[Plan]:
    """A few rejected plans per rule: for memory the closest to fitting, else distinct messages."""
    out = []
    for rule, items in sorted(grouped_rejections(result).items()):
        if rule == "memory":
            items = sorted(items, key=lambda it: it[0].memory.total if it[0].memory else math.inf)
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


def json_records(result: SearchResult, *, top: int = 10) -> list[dict]:
    """The plans of :func:`text_report` as records: the top fitting plans, then a few rejected
    ones per rule (``fits`` false, ``reasons`` saying why)."""
    return [p.to_json() for p in [*result.plans[:top], *representatives(result)]]


def json_report(result: SearchResult, *, top: int = 10, fields: Mapping[str, object] | None = None) -> str:
    """:func:`json_records` as a JSON list (``ptdp plan --json``), ``fields`` of the request (such
    as ``global_batch_size_source``) added to every record."""
    return json.dumps([{**record, **(fields or {})} for record in json_records(result, top=top)], indent=2)


ABBREVIATIONS = (
    "tp/cp/pp/dp/ep/etp: tensor/context/pipeline/data/expert/expert-tensor-parallel sizes; b: micro batch "
    "size; v: model chunks per "
    "pipeline rank; rec none/sel/full: activation recomputation; sp: sequence parallel; do: distributed "
    "optimizer (sharding optim); og/ogp: sharding optim_grads/optim_grads_params; "
    "tp_comm/cp_comm/pp_comm/dp_comm/ep_comm/edp_comm: exposed "
    "communication of each axis (ep_comm: the MoE all-to-alls; edp_comm: the experts' gradient reduction)"
)


def plot_label(rank: int, plan: Plan) -> str:
    """The x label of one layout in :func:`plot` (abbreviations in :data:`ABBREVIATIONS`)."""
    lay = plan.layout
    shard = {"no_shard": "", "optim": " do", "optim_grads": " og", "optim_grads_params": " ogp"}[lay.sharding_strategy]
    return (
        f"#{rank} tp{lay.tp}{f' cp{lay.cp}' if lay.cp > 1 else ''} pp{lay.pp} dp{lay.dp}"
        f"{f' ep{lay.ep}' if lay.ep > 1 else ''}{f' etp{lay.etp}' if lay.etp > 1 else ''} b{lay.micro_batch_size} "
        f"v{lay.virtual_stages}{_schedule_words(lay).replace(' schedule=', ' ')} rec {lay.recompute[:4]}"
        f"{' sp' if lay.parallel.sequence_parallel else ''}{shard}"
    )


def time_axis_floor(steps: list[float]) -> float:
    """Where the zoomed step-time axis starts: below the fastest layout by a quarter of the
    spread (at 0 when the layouts differ by more than the fastest one's time)."""
    low, high = min(steps), max(steps)
    if high - low >= low:
        return 0.0
    return max(0.0, low - 0.25 * (high - low) - 0.02 * low)


def plot(result: SearchResult, path: str, *, capacity_bytes: float, top: int = 10) -> None:
    """The ``top`` layouts (as many as the table lists), saved as an image at ``path``: stacked
    bars of the memory (GiB, the GPU's capacity as a labelled dashed line) and of the step-time
    breakdown (s, from 0), and each layout's step time on an axis that starts near the fastest
    (its start written on it) so that differences show. Legends sit beside the axes, never on
    the bars; a footnote below them, wrapped to the figure's width, explains the abbreviations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = result.plans[:top]
    if not plans:
        raise ValueError("no layout fits: nothing to plot")
    labels = [plot_label(i + 1, p) for i, p in enumerate(plans)]
    xs = range(len(plans))
    moe = any(p.need_time().ep_comm or p.need_time().edp_comm for p in plans)
    fig, (ax_m, ax_t, ax_s) = plt.subplots(
        1, 3, figsize=(max(15, 1.9 * len(plans) + 6), 6), gridspec_kw={"width_ratios": [1, 1, 0.7]}
    )
    for ax, keys, get, unit in (
        (ax_m, _MEM, lambda p, k: getattr(p.need_memory(), k) / GiB, "GiB"),
        (ax_t, _MOE_TIME if moe else _TIME, lambda p, k: getattr(p.need_time(), k), "s per step"),
    ):
        bottom = [0.0] * len(plans)
        for key in keys:
            values = [get(p, key) for p in plans]
            ax.bar(xs, values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel(unit)
    capacity = capacity_bytes / GiB
    ax_m.axhline(capacity, color="k", ls="--", lw=1, label=f"GPU capacity ({capacity:,.0f} GiB)")
    ax_m.text(len(plans) - 0.5, capacity, f"capacity {capacity:,.0f} GiB", ha="right", va="bottom", fontsize=7)
    ax_m.set_ylim(0, max(capacity, max(p.need_memory().total for p in plans) / GiB) * 1.08)
    steps = [p.need_time().step for p in plans]
    floor = time_axis_floor(steps)
    ax_s.plot(list(xs), steps, "o", color="k")
    for x, step in zip(xs, steps):
        ax_s.annotate(f"{step:.4g}", (x, step), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax_s.set_ylim(floor, max(steps) + 0.15 * (max(steps) - floor or max(steps)))
    ax_s.set_ylabel(f"s per step (axis starts at {floor:.3g} s)" if floor > 0 else "s per step")
    for ax in (ax_m, ax_t, ax_s):
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=40, ha="right", rotation_mode="anchor")
    for ax in (ax_m, ax_t):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax_m.set_title("memory on the most loaded GPU")
    ax_t.set_title("step time breakdown")
    ax_s.set_title("step time, zoomed")
    # the footnote wrapped to the figure's width, the axes and their tick labels laid out above it
    footer = fig.text(0.01, 0.01, ABBREVIATIONS, fontsize=7, ha="left", va="bottom")
    chars = int(0.9 * len(ABBREVIATIONS) * fig.bbox.width / footer.get_window_extent().width)
    footer.set_text(textwrap.fill(ABBREVIATIONS, max(chars, 40)))
    fig.tight_layout(rect=(0, footer.get_window_extent().y1 / fig.bbox.height + 0.01, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
