"""The planner's prediction for a finished ``ptdp train`` run, beside what the run measured.

Parameter, gradient and optimizer bytes per rank must match exactly (padded vocabulary rows and the
tied last-stage copy included; sharded strategies count the rank's shard; optimizer = Adam's two
moments plus fp32 main parameters for bf16, not the step counters), up to bucket padding to a
multiple of dp x cp; so must the ``optim_grads``/``optim_grads_params`` transients
(:mod:`ptdp.planner.memory.transients`). Peak memory and step time are predictions; step time
needs a ``ptdp plan --calibrate`` profile. The trainer measures each rank with
:func:`measure_stage` and passes the results to :func:`check_run`.

FP8 runs (``--fp8-format``) are predicted with the planner's FP8 model of the run's recipe: the
report names the recipe and the FP8 bytes it predicts on the busiest stage (:func:`fp8_bytes`: the
weights' FP8 copies and the activations, beside the activations without FP8), which the predicted
peak memory includes.

A run with pp > 1 also reports its pipeline schedule's bubble as the planner times it (with F =
B = W, and with a profile in seconds of the predicted step; :func:`pipeline_bubble`).

MoE runs with ep or etp > 1 also compare the MoE layers' all-to-all seconds per step (the
planner's :func:`~ptdp.planner.time.moe_time.moe_exchange_times`, with a profile) with those the
trainer timed (:func:`moe_exchange_seconds`; CPU runs only: on CUDA the exchanges are not timed,
which would make the host wait inside the step), and the planner's expert load with the run's
``moe_max_rank_load``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ptdp.config.schema import Config
from ptdp.engine.comm import CommStats
from ptdp.layout.pipeline.placement import placement_of
from ptdp.planner.candidate import Candidate, run_candidate
from ptdp.planner.inputs.hardware import Cluster, GPUType
from ptdp.planner.inputs.moe_model import MoEModel, planned_model
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.fp8 import fp8_weight_copy_bytes
from ptdp.planner.memory.moe_params import expert_bytes_per_param, layout_stage_counts
from ptdp.planner.memory.params import stage_param_counts, stage_transients
from ptdp.planner.memory.strategies import strategy_bytes_per_param
from ptdp.planner.time.constants import PerfConstants, links_for
from ptdp.planner.time.moe_exchange import moe_exchange_elements
from ptdp.planner.time.moe_time import moe_exchange_times
from ptdp.planner.time.pipeline_bubble import ideal_bubble
from ptdp.planner.time.profile import default_profile_path, load_profile
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.run.profiling import process_peak_rss


def measure_stage(stage) -> dict:
    """What this rank holds: parameter, gradient and optimizer bytes, and its peak memory."""
    params = list(stage.model.parameters())
    opt = stage.optimizer
    state_bytes = main_bytes = 0
    for each in stage.optimizers:  # with expert parallelism, the experts' own optimizer too
        inner = getattr(each, "inner", each)
        state_bytes += sum(
            t.numel() * t.element_size()
            for s in (inner.state.values() if inner is not None else ())
            for k, t in s.items()
            if k != "step" and torch.is_tensor(t)
        )
        main_bytes += sum(m.numel() * m.element_size() for _, m in getattr(each, "pairs", []))
    if stage.device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(stage.device), "CUDA max allocated"
    else:
        peak, peak_kind = process_peak_rss(), "process peak RSS"
    c = stage.groups.coords
    units = getattr(opt, "units", None)  # optim_grads_params: the rank keeps its shard of the parameters
    return {
        "coords": (c.tp_rank, c.dp_rank, c.pp_rank),
        "numel": sum(p.numel() for p in params),
        "params": sum(p.numel() * p.element_size() for p in params) if units is None else units.held_bytes,
        # optim_grads_params: the most gathered parameter bytes at once (units in use and prefetched)
        "params_transient": 0 if units is None else units.peak_live_bytes,
        # optim_grads: the shard (the buffer lives during backward only); the experts' own buffer too
        "grads": stage.grads.held_bytes + (stage.expert_grads.held_bytes if stage.expert_grads is not None else 0),
        "padding": stage.grads.data.numel()
        - sum(p.numel() for p in params)
        + (sum(p.numel() for p in stage.expert_grads.params) if stage.expert_grads is not None else 0),
        "expert_padding": _padding(stage.expert_grads),
        # optim_grads: the most bucket gradient bytes allocated at once during a backward
        "grads_transient": stage.grads.peak_live_bytes,
        "optimizer": state_bytes + main_bytes,
        "peak": peak,
        "peak_kind": peak_kind,
    }


#: bytes of an activation element of each ``params_dtype`` (what the MoE exchanges send)
_ACTIVATION_BYTES = {"float64": 8.0, "float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


def moe_exchange_seconds(config: Config, stats: CommStats) -> float:
    """Host seconds counted in ``stats`` (its ``clock`` on) in the MoE layers' row exchanges, the
    ones the planner models (:func:`~ptdp.planner.time.moe_exchange.moe_exchange_elements`'s keys
    without the counts); 0 at ep = etp = 1."""
    p = config.parallel
    keys = moe_exchange_elements(1, 1, 1, ep=p.ep, etp=p.etp, dispatcher=p.moe_token_dispatcher_type, padded=True)
    return sum(stats.total(*key.split("/")).seconds for key in keys)


def _padding(buffer) -> int:
    """Elements of ``buffer`` (a GradBuffer or None) beyond its parameters: bucket padding."""
    return 0 if buffer is None else buffer.data.numel() - sum(p.numel() for p in buffer.params)


def predicted_transients(config: Config, layout: Candidate, pp_rank: int) -> dict[str, int]:
    """The planner's transients of a rank of stage ``pp_rank`` in bytes (0 unless the run's
    strategy is ``optim_grads`` / ``optim_grads_params`` over dp x cp > 1): ``params_transient``
    gathered 16-bit (or float32) weights, ``grads_transient`` float32 gradient buckets
    (:func:`ptdp.planner.memory.params.stage_transients`, as the planner's memory counts them)."""
    m = planned_model(config)
    layers = config.pipeline.stage_layers[pp_rank]
    params, grads = stage_transients(m, layout, pp_rank, layers, m.make_vocab_size_divisible_by)
    weight, grad, _ = strategy_bytes_per_param(layout.precision, "no_shard", 1, bf16_grads=layout.bf16_grads)
    return {"params_transient": int(weight * params), "grads_transient": int(grad * grads)}


def fp8_bytes(config: Config, layout: Candidate) -> dict[str, Any]:
    """The FP8 bytes the planner predicts for a run with ``--fp8-format`` on one tp rank of the
    pipeline stage where they are largest: the weights' FP8 copies
    (:func:`~ptdp.planner.memory.fp8.fp8_weight_copy_bytes`) and the activations at their peak
    (:func:`~ptdp.planner.memory.activations.rank_activation_bytes`), with those activations
    without FP8 (the same run's parameters' dtype)."""
    m, p, fp8 = planned_model(config), config.parallel, config.fp8
    plain = dataclasses.replace(
        layout, precision="bf16" if layout.precision == "fp8" else layout.precision, fp8_recipe=None
    )
    schedule = "gpipe" if p.schedule == "gpipe" else "1f1b"
    activations = partial(
        rank_activation_bytes, m, schedule=schedule, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by
    )
    rows = []
    for rank, layers in enumerate(config.pipeline.stage_layers):
        copies = fp8_weight_copy_bytes(m, p.tp, layers, True, ep=p.ep, etp=p.etp, experts=True)
        act = activations(layout, rank, layers)
        rows.append((copies + act, rank, copies, act, activations(plain, rank, layers)))
    _, rank, copies, act, without = max(rows)
    return {
        "format": fp8.fp8_format,
        "recipe": fp8.fp8_recipe,
        "stage": rank,
        "predicted_weight_copy_bytes": copies,
        "predicted_activation_bytes": act,
        "predicted_activation_bytes_without_fp8": without,
    }


def pipeline_bubble(config: Config) -> dict[str, Any]:
    """The run's pipeline schedule and its bubble as the planner times it
    (:func:`~ptdp.planner.time.pipeline_bubble.ideal_bubble`): the step's idle time with F = B = W
    and free transfers over its work; with a profile :func:`compare` adds the predicted seconds."""
    p = config.parallel
    kind, m, v = p.schedule, config.num_microbatches, config.pipeline.virtual_stages
    return {"schedule": kind, "bubble_fraction": ideal_bubble(kind, p.pp, m, v)}


def recompute_note(config: Config) -> str | None:
    """Why the planner's activation memory is approximate for this run's full recompute, if it is."""
    m = config.model
    if m.recompute_granularity != "full" or (m.recompute_method, m.recompute_num_layers) in (
        (None, None),
        ("uniform", 1),
    ):
        return None
    return (
        f"the planner models full recompute of every layer (uniform, 1 layer per group), not "
        f"{m.recompute_method} with {m.recompute_num_layers} layers"
    )


def compare(
    config: Config,
    per_rank: list[dict],
    mean_step_s: float | None,
    profile: Path | None,
    *,
    moe_max_rank_load: float | None = None,
) -> dict:
    """The planner's numbers for the run's layout next to the measured ones (JSON-able). MoE runs:
    the state bytes of every rank (:func:`_moe_rank_row`) and, with ep or etp > 1, the exchanges
    and the expert load (:func:`_moe_checks`: each rank's ``moe_exchange_s``, the mean of the
    steps' ``moe_max_rank_load``)."""
    if config.moe.enabled:  # float64 as twice float32
        wide = config.model.params_dtype == "float64"
        layout = run_candidate(config, "fp32" if wide else None)
        assert layout is not None
        rows = [_moe_rank_row(config, layout, r, 2.0 if wide else 1.0) for r in per_rank]
        exact = [row["exact"] for row in rows]
        moe: dict[str, Any] = {
            "bytes_exact_on_every_rank": None if None in exact else all(exact),
            "ranks": rows,
            "limits": "compared: the state bytes of every rank and, with ep or etp > 1, the all-to-all time and "
            "the expert load; not yet: an MoE run's step time and peak memory",
        }
        if config.parallel.ep * config.parallel.etp > 1:
            moe.update(_moe_checks(config, layout, per_rank, profile, moe_max_rank_load))
        if layout.fp8:
            moe["fp8"] = fp8_bytes(config, layout)
        if config.parallel.pp > 1:
            moe["pipeline"] = pipeline_bubble(config)
        return moe
    layout = run_candidate(config)
    if layout is None:
        return {"note": f"the planner does not model params_dtype={config.model.params_dtype}"}
    model, p = config.model, config.parallel
    split = config.pipeline.layer_split
    counts = stage_param_counts(
        model,
        p.tp,
        p.pp,
        make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
        layer_split=split,
        placement=placement_of(p.schedule),
    )
    rows = [_rank_row(config, layout, r, counts[r["coords"][2]]) for r in per_rank]
    out: dict[str, Any] = {
        "bytes_exact_on_every_rank": all(row["exact"] for row in rows),
        "ranks": rows,
        "peak_memory": {
            "measured_max_bytes": max(r["peak"] for r in per_rank),
            "measured_kind": per_rank[0]["peak_kind"],
        },
    }
    if layout.fp8:
        out["fp8"] = fp8_bytes(config, layout)
    if p.pp > 1:
        out["pipeline"] = pipeline_bubble(config)
    loaded = _profile(profile, "step time")
    if isinstance(loaded, str):
        out["step_time"] = {"note": loaded}
        return out
    gpu, constants = loaded
    cluster = Cluster(gpu, config.world_size, config.world_size)  # ptdp train's workers share one machine
    # the run's --overlap-grad-reduce, as ptdp plan credits it (PerfConstants.overlap_window)
    constants = constants.with_overlap(overlap_grad_reduce=layout.parallel.overlap_grad_reduce)
    memory = memory_breakdown(
        model,
        layout,
        gpu,
        overhead_bytes=0.0,
        layer_split=split,
        schedule="gpipe" if p.schedule == "gpipe" else "1f1b",
        make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
    )
    out["peak_memory"]["predicted_bytes"] = memory.total
    note = recompute_note(config)
    if note:
        out["peak_memory"]["note"] = note
    if ("bf16" if layout.precision == "fp8" else layout.precision) in gpu.peak_flops and mean_step_s:
        perf = evaluate_performance(
            model,
            layout,
            cluster,
            constants,
            layer_split=split,
            make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by,
        )
        error = perf.time.step / mean_step_s - 1.0
        if "pipeline" in out:
            out["pipeline"]["predicted_bubble_s"] = perf.time.bubble
            out["pipeline"]["predicted_step_share"] = perf.time.bubble / perf.time.step
        out["step_time"] = {
            "predicted_s": perf.time.step,
            "measured_s": mean_step_s,
            "error": error,
            "within_25_percent": abs(error) <= 0.25,
            "profile": str(profile),
        }
    return out


def _profile(profile: Path | None, what: str) -> tuple[GPUType, PerfConstants] | str:
    """The GPU and constants of ``profile``, or a note saying why ``what`` is not predicted."""
    if profile is None or not profile.is_file():
        return f"no hardware profile: run `ptdp plan --calibrate` to predict {what}"
    try:
        return load_profile(profile)
    except ValueError as e:
        return str(e)


def predicted_exchange_s(config: Config, layout: Candidate, gpu: GPUType, constants: PerfConstants) -> list[float]:
    """Seconds per step of the MoE layers' row exchanges on a rank of each pipeline stage, as the
    planner models them: the stage's MoE layers x m micro-batches x
    :func:`~ptdp.planner.time.moe_time.moe_exchange_times` (the rank's routed tokens, the run's
    activation bytes, the profile's links for one machine's workers at its
    ``moe_exchange_efficiency``), 1.5 x with full recompute (the forward's again); on a CPU whose
    workers outnumber its cores, x workers / cores (the calibration's times are per core)."""
    m, p, split = config.model, config.parallel, config.pipeline
    model = planned_model(config)
    assert isinstance(model, MoEModel)
    links = links_for(Cluster(gpu, config.world_size, config.world_size), constants)
    routed = config.train.micro_batch_size * m.seq_length // p.cp // (p.tp if p.sequence_parallel else 1)
    elem = _ACTIVATION_BYTES[str(m.params_dtype)]
    one = moe_exchange_times(
        model, routed, p.ep, p.etp, p.moe_token_dispatcher_type, links, elem, constants.moe_exchange_efficiency
    )
    if layout.recompute == "full" or "moe" in layout.modules:
        one *= 1.5
    if gpu.shared_cores and config.world_size > gpu.shared_cores:
        one *= config.world_size / gpu.shared_cores
    is_moe = config.moe.moe_layers(m.num_layers)
    chunks = range(split.virtual_stages)
    layers = [sum(is_moe[i] for c in chunks for i in split.chunk_layer_ids(r, c)) for r in range(p.pp)]
    return [config.num_microbatches * n * one for n in layers]


def _moe_checks(
    config: Config, layout: Candidate, per_rank: list[dict], profile: Path | None, max_rank_load: float | None
) -> dict:
    """``moe_exchange``: the busiest stage's :func:`predicted_exchange_s` (with a profile) against
    the largest of the ranks' ``moe_exchange_s`` (None where a rank has none: not timed on CUDA);
    ``expert_load``: the planner's ``load_imbalance`` against the run's mean ``moe_max_rank_load``."""
    timed = [r.get("moe_exchange_s") for r in per_rank]
    measured = max(t for t in timed if t is not None) if timed and None not in timed else None
    exchange: dict[str, Any] = {"measured_s": measured}
    if measured is None:
        exchange["measured_note"] = "not timed on CUDA (timing them would make the host wait inside the step)"
    loaded = _profile(profile, "it")
    if isinstance(loaded, str):
        exchange["note"] = loaded
    else:
        predicted = max(predicted_exchange_s(config, layout, *loaded))
        exchange.update(predicted_s=predicted, profile=str(profile))
        if measured:
            exchange["error"] = predicted / measured - 1.0
    model = planned_model(config)
    assert isinstance(model, MoEModel)
    predicted_load = model.busiest_load(config.parallel.ep) / model.kept_share
    return {"moe_exchange": exchange, "expert_load": {"predicted": predicted_load, "measured": max_rank_load}}


def _rank_row(config: Config, layout, r: dict, n: int) -> dict:
    """One rank's predicted and measured state bytes and transients (``n``: its stage's parameters)."""
    p = config.parallel
    # the run's sharding strategy over the dp x cp ranks holding the same parameters
    per_param = strategy_bytes_per_param(
        layout.precision, p.sharding_strategy, p.dp * p.cp, bf16_grads=p.grad_reduce_in_bf16
    )
    predicted = {"numel": n, "params": n * per_param[0], "grads": n * per_param[1], "optimizer": n * per_param[2]}
    # the sharded strategies pad each bucket to a multiple of dp x cp: the padding elements are
    # the only allowed difference (grads: whole padding, optim_grads its 1/(dp cp) share;
    # optimizer: its 1/(dp cp) share; params: optim_grads_params's 1/(dp cp) share)
    pad = r.get("padding", 0)
    slack = {
        "numel": 0,
        "params": pad * per_param[0] if p.sharding_strategy == "optim_grads_params" else 0,
        "grads": pad * per_param[1],
        "optimizer": pad * per_param[2],
    }
    transients = predicted_transients(config, layout, r["coords"][2])
    measured_transients = {k: r.get(k, 0) for k in transients}
    same = all(0 <= r[k] - predicted[k] <= slack[k] for k in predicted) and measured_transients == transients
    return {
        "coords": r["coords"],
        "predicted": predicted,
        "padding_elements": pad,
        "measured": {k: r[k] for k in predicted},
        "transients": {"predicted": transients, "measured": measured_transients},
        "exact": same,
    }


def _moe_rank_row(config: Config, layout, r: dict, scale: float = 1.0) -> dict:
    """One rank of an MoE run: its predicted state bytes (:mod:`ptdp.planner.memory.moe_params`:
    the stage's dense parameters under the run's strategy over dp x cp, with ep = etp = 1 the experts
    among them; else the rank's experts whole, their Adam state over edp when sharded) against the
    measured ones. Exact up to bucket padding; with ``optim_grads`` / ``optim_grads_params`` over
    more than one rank also the transients when every layer is an MoE layer (the planner replays
    each layer as the model's most common kind: with dense layers among them ``exact`` None).
    ``scale``: bytes per value over the layout's precision's (2 for float64 counted as float32)."""
    p = config.parallel
    stage = r["coords"][2]
    counts, own = layout_stage_counts(
        planned_model(config), layout, layout.layer_split, config.model.make_vocab_size_divisible_by
    )
    dense, experts = counts[stage], own[stage]  # experts: those in their own buffer
    per_param = tuple(
        scale * b
        for b in strategy_bytes_per_param(
            layout.precision, p.sharding_strategy, p.dp * p.cp, bf16_grads=p.grad_reduce_in_bf16
        )
    )
    expert_param = tuple(scale * b for b in expert_bytes_per_param(layout.precision, p))
    predicted = {
        "numel": dense + experts,
        **{k: dense * per_param[i] + experts * expert_param[i] for i, k in enumerate(("params", "grads", "optimizer"))},
    }
    pad, expert_pad = r.get("padding", 0), r.get("expert_padding", 0)  # each buffer's, to a multiple of its group
    slack = {
        "numel": 0,
        "params": 0.0,
        "grads": pad * per_param[1] + expert_pad * expert_param[1],
        "optimizer": pad * per_param[2] + expert_pad * expert_param[2],
    }
    row = {"coords": r["coords"], "predicted": predicted, "measured": {k: r[k] for k in predicted}}
    same = all(0 <= r[k] - predicted[k] <= slack[k] for k in predicted)
    if p.sharding_strategy in ("optim_grads", "optim_grads_params") and p.dp * p.cp > 1:
        if not all(config.moe.moe_layers(config.model.num_layers)):  # dense layers among them: not modelled
            return {**row, "exact": None}
        transients = {k: int(scale * n) for k, n in predicted_transients(config, layout, stage).items()}
        measured = {k: r.get(k, 0) for k in transients}
        row["transients"] = {"predicted": transients, "measured": measured}
        same = same and measured == transients
    return {**row, "exact": same}


def profile_path(config: Config) -> Path | None:
    """The run's ``--hardware-profile``, else the default profile when one was calibrated, else None."""
    if config.hardware_profile:
        return Path(config.hardware_profile)
    path = default_profile_path()
    return path if path.is_file() else None


def check_run(
    config: Config, per_rank: list[dict], mean_step_s: float | None, *, moe_max_rank_load: float | None = None
) -> dict:
    """The end-of-run hook: :func:`compare` with the run's hardware profile (see :func:`profile_path`)."""
    return compare(config, per_rank, mean_step_s, profile_path(config), moe_max_rank_load=moe_max_rank_load)


def format_comparison(check: dict) -> list[str]:
    """A few lines for the end-of-run summary."""
    if "note" in check:
        return [f"  planner: {check['note']}"]
    lines = ["  planner vs measured, per rank:"]
    stages: dict[int, dict] = {}  # pp rank -> its first rank's record
    for r in check["ranks"]:
        stages.setdefault(r["coords"][2], r)
    for pp_rank, r in sorted(stages.items()):
        pr, me = r["predicted"], r["measured"]
        lines.append(
            f"    stage {pp_rank}: params {pr['params']:,.0f} / {me['params']:,} B, grads {pr['grads']:,.0f} / "
            f"{me['grads']:,} B, optimizer {pr['optimizer']:,.0f} / {me['optimizer']:,} B (predicted / measured)"
        )
        tr = r.get("transients")
        if tr and any(tr["predicted"].values()):
            lines.append(
                f"      at their peaks: gathered params {tr['predicted']['params_transient']:,} / "
                f"{tr['measured']['params_transient']:,} B, gradient buckets {tr['predicted']['grads_transient']:,} / "
                f"{tr['measured']['grads_transient']:,} B"
            )
    padded = any(r.get("padding_elements") for r in check["ranks"])
    exact = check["bytes_exact_on_every_rank"]
    verdict = (
        "not modelled (sharded gradients with dense layers among MoE layers)"
        if exact is None
        else "yes"
        if exact
        else "NO"
    )
    lines.append(f"    bytes equal on every rank{' (up to bucket padding)' if padded else ''}: {verdict}")
    if "limits" in check:  # an MoE run: its state bytes, with ep or etp > 1 its exchanges and load
        return [*lines, *_moe_lines(check), *_fp8_and_pipeline_lines(check), f"    ({check['limits']})"]
    pm = check["peak_memory"]
    predicted = (
        f"{pm['predicted_bytes'] / 2**20:,.0f} MiB predicted (model state + activations), "
        if "predicted_bytes" in pm
        else ""
    )
    lines.append(
        f"    peak memory: {predicted}{pm['measured_max_bytes'] / 2**20:,.0f} MiB measured ({pm['measured_kind']})"
    )
    if "note" in pm:
        lines.append(f"      ({pm['note']})")
    lines += _fp8_and_pipeline_lines(check)
    st = check.get("step_time", {})
    if "predicted_s" in st:
        verdict = "within" if st["within_25_percent"] else "NOT within"
        lines.append(
            f"    step time: {st['predicted_s']:.3f} s predicted, {st['measured_s']:.3f} s measured "
            f"({100 * st['error']:+.0f}%, {verdict} 25%; profile {st['profile']})"
        )
    elif "note" in st:
        lines.append(f"    step time: {st['note']}")
    return lines


def _fp8_and_pipeline_lines(check: dict) -> list[str]:
    """The FP8 bytes' and the pipeline bubble's lines of :func:`format_comparison`, where the run has them."""
    lines: list[str] = []
    if "fp8" in check:
        f = check["fp8"]
        lines.append(
            f"    FP8 ({f['format']}, {f['recipe']} recipe), stage {f['stage']}: "
            f"{f['predicted_weight_copy_bytes'] / 2**20:,.1f} MiB FP8 weight copies + "
            f"{f['predicted_activation_bytes'] / 2**20:,.1f} MiB activations predicted "
            f"({f['predicted_activation_bytes_without_fp8'] / 2**20:,.1f} MiB without FP8; part of the peak memory)"
        )
    if "pipeline" in check:
        pl = check["pipeline"]
        seconds = (
            f"; {pl['predicted_bubble_s']:.3f} s predicted, {100 * pl['predicted_step_share']:.1f}% of the step"
            if "predicted_bubble_s" in pl
            else ""
        )
        lines.append(
            f"    {pl['schedule']} schedule: the step idles {100 * pl['bubble_fraction']:.1f}% of its work "
            f"with F = B = W (simulated){seconds}"
        )
    return lines


def _moe_lines(check: dict) -> list[str]:
    """The MoE exchanges' and expert load's lines of :func:`format_comparison` (none at ep = etp = 1)."""
    if "moe_exchange" not in check:
        return []
    ex, load = check["moe_exchange"], check["expert_load"]
    parts = []
    if "predicted_s" in ex:
        parts.append(f"{1e3 * ex['predicted_s']:.3g} ms predicted (busiest stage)")
    if ex["measured_s"] is not None:
        parts.append(f"{1e3 * ex['measured_s']:.3g} ms measured (slowest rank)")
    error = f" ({100 * ex['error']:+.0f}%)" if "error" in ex else ""
    lines = [f"    MoE all-to-all per step: {', '.join(parts) or 'neither predicted nor measured'}{error}"]
    if "note" in ex:
        lines.append(f"      (not predicted: {ex['note']})")
    if "measured_note" in ex:
        lines.append(f"      (not measured: {ex['measured_note']})")
    measured = "not measured" if load["measured"] is None else f"{load['measured']:.2f} measured (mean over steps)"
    lines.append(f"    expert load (busiest ep rank over the mean): {load['predicted']:.2f} predicted, {measured}")
    return lines
