"""Prediction of the layouts the search enumerates: rules, memory, time; the sharding strategies
and the pipeline split tried for each layout.

:func:`evaluate` predicts one layout (:mod:`ptdp.planner.search.rules`,
:func:`ptdp.planner.memory.breakdown.memory_breakdown`,
:func:`ptdp.planner.time.step_time.evaluate_performance`); :func:`predict_strategies` predicts it
under the sharding strategies worth trying and the candidate splits of :mod:`ptdp.planner.splits`.
"""

from __future__ import annotations

from functools import partial

from ptdp.config.model import ModelConfig
from ptdp.errors import Violation
from ptdp.layout.buckets import chunk_by_chunk
from ptdp.planner.candidate import Candidate, Plan
from ptdp.planner.inputs.hardware import TFLOPS, Cluster, GiB
from ptdp.planner.inputs.moe_model import MoEModel
from ptdp.planner.memory.activations import cached_rank_activation_bytes
from ptdp.planner.memory.breakdown import activation_schedule, memory_breakdown
from ptdp.planner.memory.overhead import CUDA_CONTEXT_BYTES, runtime_overhead_bytes
from ptdp.planner.memory.params import layer_param_count, mean_stage_params
from ptdp.planner.memory.strategies import strategy_bytes_per_param
from ptdp.planner.search.ranking import Pending, fastest
from ptdp.planner.search.rules import all_rejections, schedule_rejections
from ptdp.planner.splits import candidate_splits
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.pipeline_bubble import splits_backward
from ptdp.planner.time.stages import edge_layer_equivalents
from ptdp.planner.time.step_time import evaluate_performance


def evaluate(
    model: ModelConfig,
    layout: Candidate,
    cluster: Cluster,
    *,
    constants=DEFAULT_CONSTANTS,
    overhead_bytes: float | None = None,
) -> tuple[Plan, Violation | None]:
    """Predict one layout: rules, then memory, then (if it fits) time. Returns the plan and the
    first rejection (None when it fits)."""
    broken = all_rejections(model, layout, cluster)
    if broken:
        return Plan(layout, False, reasons=[r.message for r in broken]), broken[0]
    plan, rejection = _predict(model, layout, cluster, constants, overhead_bytes)
    return (plan.timed() if isinstance(plan, Pending) else plan), rejection


def _predict(model, layout, cluster, constants, overhead_bytes) -> tuple[Plan | Pending, Violation | None]:
    """Memory, then, if it fits, time; a schedule running B and W apart is :class:`Pending`, its
    bubble simulated when the ranking needs it."""
    kwargs = {} if overhead_bytes is None else {"overhead_bytes": overhead_bytes}
    memory = memory_breakdown(model, layout, cluster.gpu, gpus_per_node=cluster.gpus_per_node, **kwargs)
    capacity = cluster.gpu.memory_bytes
    if memory.total > capacity:
        largest = max(("params", "grads", "optimizer", "activations"), key=lambda k: getattr(memory, k))
        digits = 2 if f"{memory.total / GiB:.2f}" != f"{capacity / GiB:.2f}" else 4
        message = (
            f"memory {memory.total / GiB:.{digits}f} GiB > {capacity / GiB:.{digits}f} GiB on stage "
            f"{memory.stage} ({largest} {getattr(memory, largest) / GiB:.1f} GiB)"
        )
        return Plan(layout, False, memory=memory, reasons=[message]), Violation("memory", message)
    timed = partial(_timed, model, layout, cluster, constants, memory)
    if layout.pp > 1 and splits_backward(layout.parallel.schedule):
        bound = evaluate_performance(model, layout, cluster, constants, simulate_bubble=False).time.step
        return Pending(bound, timed), None
    return timed(), None


def _timed(model, layout, cluster, constants, memory) -> Plan:
    perf = evaluate_performance(model, layout, cluster, constants)
    return Plan(layout, True, memory, perf.time, perf.tflops_per_gpu / TFLOPS, perf.mfu, passes=perf.passes)


def _predict_split(
    model, layout, cluster, constants, overhead, search_split: bool
) -> tuple[Plan | Pending, Violation | None, bool]:
    """Predict ``layout``; with ``search_split`` try the splits of :func:`candidate_splits` (from the
    edge work of :func:`edge_layer_equivalents`) and return the fastest that fits, else the one
    closest to fitting (the even split first: it wins ties). When the even split fits, an uneven
    one whose busiest stage is no lighter (layers + edge work) is not predicted: its m slots are
    no shorter. Splits whose plans are :class:`Pending` give one, timing them when needed
    (:func:`~ptdp.planner.search.ranking.fastest`). The third value: no split can fit whatever
    the sharding strategy (:func:`_sharding_cannot_fit` of every split predicted, or
    :func:`_no_split_fits` with every state byte sharded)."""
    if not search_split:
        plan, rejection = _predict(model, layout, cluster, constants, overhead)
        return plan, rejection, _sharding_cannot_fit(plan, layout, cluster)
    if _no_split_fits(model, layout, cluster, overhead):  # the even (or first) split stands for all
        split = next(iter(candidate_splits(model.num_layers, layout.pp, 0.0, 0.0)), None)
        plan, rejection = _predict(model, layout.replace(layer_split=split), cluster, constants, overhead)
        return plan, rejection, _no_split_fits_sharded(model, layout, cluster, constants, overhead)
    first, last = edge_layer_equivalents(model, layout, cluster, constants)
    load = lambda s: max(s[0] + first, s[-1] + last, *s[1:-1])  # noqa: E731 - busiest stage, in layers
    best, even_load = None, None
    pending: list[Pending] = []
    hopeless = True
    for split in candidate_splits(model.num_layers, layout.pp, first, last):
        if split is not None and even_load is not None and load(split) >= even_load:
            continue
        plan, rejection = _predict(model, layout.replace(layer_split=split), cluster, constants, overhead)
        if split is None and rejection is None:
            even_load = load((model.num_layers // layout.pp,) * layout.pp)
        if isinstance(plan, Pending):
            pending.append(plan)
            continue
        hopeless = hopeless and _sharding_cannot_fit(plan, layout, cluster)
        key = (0, plan.need_time().step) if rejection is None else (1, plan.memory.total if plan.memory else 0.0)
        if best is None or key < best[0]:
            best = (key, plan, rejection)
    if len(pending) == 1:
        return pending[0], None, False
    if pending:
        return Pending(min(p.bound for p in pending), partial(fastest, tuple(pending))), None, False
    if best is None:  # no split balances the edge work within one layer of the middle stages
        message = (
            f"num_layers={model.num_layers} has no balanced split over pp={layout.pp} stages (the first "
            f"and last stages also carry the embedding and the output layer + loss, {first:.1f} and "
            f"{last:.1f} layers' worth; rule: each stage >= 1 layer, the first and last at most one "
            f"layer above the middle ones); give --pipeline-layer-split to plan a split of your own"
        )
        return Plan(layout, False, reasons=[message]), Violation("layers % pp", message), False
    return best[1], best[2], hopeless and best[2] is not None


def _no_split_fits(model, layout: Candidate, cluster, overhead, strategy: str | None = None) -> bool:
    """True when no split of the layers can fit under ``strategy`` (default the layout's): the mean
    stage's state bytes (a lower bound of the most loaded stage's,
    :func:`~ptdp.planner.memory.params.mean_stage_params`; transients, activations and FP8 copies
    left out) and the overhead already exceed the GPU."""
    floor = mean_stage_params(model, layout.tp, layout.pp) * _state_per_param(
        layout, strategy or layout.sharding_strategy
    )
    return floor + (CUDA_CONTEXT_BYTES if overhead is None else overhead) > cluster.gpu.memory_bytes


def _no_split_fits_sharded(model, layout: Candidate, cluster, constants, overhead) -> bool:
    """True when no split :func:`_predict_split` tries can fit under any sharding strategy: with
    ``pp >= 3`` every split it tries gives rank 1 at least ``c`` layers (``c`` the fewest of any
    middle stage of them), so rank 1 needs at least their activations (more layers, more
    activations) and, dense, their parameters fully sharded, besides the overhead; else the mean
    stage's state fully sharded (:func:`_no_split_fits`)."""
    if _no_split_fits(model, layout, cluster, overhead, "optim_grads_params"):
        return True
    if layout.pp < 3:
        return False
    first, last = edge_layer_equivalents(model, layout, cluster, constants)
    splits = [
        s or (model.num_layers // layout.pp,) * layout.pp
        for s in candidate_splits(model.num_layers, layout.pp, first, last)
    ]
    if not splits:
        return False
    thinnest = min(splits, key=lambda s: s[1])
    shaped = layout.replace(layer_split=thinnest)
    floor = cached_rank_activation_bytes(model, shaped, 1, thinnest[1], activation_schedule(layout), 128)
    if not isinstance(model, MoEModel):  # the same parameters in every layer
        floor += thinnest[1] * layer_param_count(model, layout.tp) * _state_per_param(layout, "optim_grads_params")
    floor += runtime_overhead_bytes(layout, cluster.gpus_per_node, model.tied) if overhead is None else overhead
    return floor > cluster.gpu.memory_bytes


def _sharding_cannot_fit(unsharded: Plan | Pending, layout: Candidate, cluster) -> bool:
    """True when ``unsharded`` (a no_shard plan that did not fit, at its split) would not fit even with every
    state byte sharded: its most loaded stage's ``n`` parameters (its float32 gradients / 4) keep
    at least ``n (w + g + k) / (dp cp)`` bytes of state under optim_grads_params, besides the
    same activations and overhead (a lower bound: transients and FP8 copies left out). With bf16
    gradients its grads hold at most 6 bytes per parameter (2, and the step's float32 copy)."""
    mem = unsharded.memory if isinstance(unsharded, Plan) else None
    if mem is None:
        return False
    n = mem.grads / (6.0 if layout.bf16_grads else 4.0)
    floor = _state_per_param(layout, "optim_grads_params") * n
    return mem.activations + mem.overhead + floor > cluster.gpu.memory_bytes


def _state_per_param(layout: Candidate, strategy: str) -> float:
    """Bytes of state per parameter of ``layout`` under sharding ``strategy`` over its ``dp cp`` ranks."""
    return sum(
        strategy_bytes_per_param(
            layout.precision,
            strategy,
            layout.shard_size,
            bf16_grads=layout.bf16_grads,
            optimizer=layout.optimizer_state,
        )
    )


def predict_strategies(
    model,
    make,
    strategies: list[str],
    cluster,
    constants,
    overhead,
    search_split: bool,
    over: dict[str, Plan] | None = None,
    over_hopeless: bool = False,
) -> tuple[list[Plan | Pending], list[tuple[Plan, Violation]], bool]:
    """Predict the layout ``make(strategy)`` gives under ``strategies`` (least sharded first): no_shard;
    when it fits, optim too; when not, the sharded ones up to the first that fits, unless full
    sharding cannot fit (:func:`_sharding_cannot_fit`); and optim_grads whenever it reduces chunk by
    chunk (:func:`~ptdp.layout.buckets.chunk_by_chunk`), when it can be faster than optim. A more
    sharded strategy is otherwise never faster in this model. ``over``: per strategy, the plan of
    the same layout under a schedule keeping no more activations that did not fit in memory: that
    strategy is passed over, neither predicted nor returned (the same splits would be tried, each
    needing at least as much; the other plan says why); ``over_hopeless``: that schedule could not
    fit under any strategy from the first on. Returns (the plans kept, the rejected plans with the
    rule each broke, least sharded first; whether the first strategy showed that no strategy fits).
    """
    first = make(strategies[0])
    bad = schedule_rejections(model, first)  # the same for every strategy
    if bad:
        return [], [(Plan(first, False, reasons=[r.message for r in bad]), bad[0])], False
    outcomes: dict[str, tuple[Plan | Pending, Violation | None]] = {}
    over = over or {}
    hopeless = over_hopeless and strategies[0] in over

    def fits(strategy: str) -> bool:
        nonlocal hopeless
        layout = first if strategy == strategies[0] else make(strategy)
        if strategy in over:
            return False
        plan, rejection, none_fits = _predict_split(model, layout, cluster, constants, overhead, search_split)
        outcomes[strategy] = plan, rejection
        if strategy == strategies[0]:
            hopeless = none_fits
        return rejection is None

    if fits(strategies[0]):
        if len(strategies) > 1:
            fits(strategies[1])
    elif len(strategies) > 1 and not hopeless:
        next((s for s in strategies[1:] if fits(s)), None)
    by_chunk = "optim_grads" in strategies and chunk_by_chunk(
        "optim_grads", first.shard_size, first.virtual_stages, first.num_microbatches, first.pp
    )
    if by_chunk and "optim_grads" not in outcomes:  # may be faster than optim: one chunk's reduction exposed
        fits("optim_grads")
    plans: list[Plan | Pending] = []
    rejected: list[tuple[Plan, Violation]] = []
    kept_sharded = False
    for strategy in strategies:
        if strategy not in outcomes:
            continue
        plan, rejection = outcomes[strategy]
        if rejection is not None:
            if isinstance(plan, Plan):  # a rejected plan is never pending
                rejected.append((plan, rejection))
        elif strategy == "no_shard" or not kept_sharded or (by_chunk and strategy == "optim_grads"):
            plans.append(plan)
            kept_sharded = strategy != "no_shard"
    return plans, rejected, hopeless
