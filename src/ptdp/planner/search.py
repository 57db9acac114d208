"""Search every valid layout for a model on a cluster, predict each, rank by step time.

The search enumerates tp x cp x pp x dp = number of GPUs, micro batch size, virtual pipeline
stages, recompute granularity, sequence parallelism, the data-parallel sharding strategy and the
pipeline split (even, uneven first/last stages, or interleaved with the embedding and/or loss
counted as layers: :mod:`ptdp.planner.splits`, the fastest fitting split kept per layout); any of
them can be fixed.

Pruning (each keeps the search exact up to the stated approximation, and fast: the full Llama 3
405B search on 16,384 GPUs stays well under 2 s):

* context parallelism: cp > 1 only with ``seq_length >= CP_MIN_SEQ_LENGTH``
  (:data:`ptdp.planner.context.CP_MIN_SEQ_LENGTH`) or when no layout fits with cp = 1 (a second
  pass), and only sizes with ``seq_length % (2 cp) == 0`` and ``seq_length / cp >=
  CP_MIN_LOCAL_TOKENS``, with micro batch 1 (cp cuts each sequence's tokens per rank; b > 1 would
  multiply them back); a fixed ``--cp`` is searched as given.
* sharding strategies (:func:`_predict_strategies`): ``no_shard`` and, when it fits, ``optim``;
  when it does not, the sharded ones in order up to the first that fits, none when a lower bound
  of the fully sharded memory already exceeds the GPU. A more sharded strategy keeps less memory but is never
  faster in this model (its extra reduce-scatters per microbatch and parameter all-gathers come
  on top), except for the optimizer step's 8 bytes per parameter of gradient-norm and zeroing
  traffic it shards, which the pruning gives up, and for ``optim_grads`` reducing chunk by chunk
  (interleaved, one round: :func:`ptdp.planner.sharding.chunk_by_chunk`), which exposes only the
  last chunk's reduce-scatter and is always evaluated. ``dp * cp = 1`` has nothing to shard: no_shard. Layouts that break a rule (:mod:`ptdp.planner.rules`, the same rules ``ptdp train``
checks) or do not fit in memory are kept as rejected plans with their reasons.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ptdp.planner.context import CP_MIN_LOCAL_TOKENS, CP_MIN_SEQ_LENGTH
from ptdp.planner.hardware import TFLOPS, Cluster, GiB
from ptdp.planner.memory import DEFAULT_OVERHEAD_BYTES, mean_stage_params, memory_breakdown
from ptdp.planner.models import ModelSpec
from ptdp.planner.perf import DEFAULT_CONSTANTS, edge_layer_equivalents, evaluate_performance
from ptdp.planner.plan import RECOMPUTE, SHARDING, Layout, Plan
from ptdp.planner.rules import Rejection, all_rejections, context_rejections, schedule_rejections, structural_rejections
from ptdp.planner.sharding import chunk_by_chunk, strategy_bytes_per_param
from ptdp.planner.splits import ACCOUNTING, candidate_splits, interleaved_splits
from ptdp.spec import ConfigError, ParallelConfig, accounted_split, first_last_split, schedule_violations

MAX_MICRO_BATCH = 32


@dataclass(frozen=True)
class Fixed:
    """Choices the user fixed; None means "search it"."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    virtual_stages: int | None = None
    layers_per_virtual_stage: int | None = None
    """Megatron's --num-layers-per-virtual-pipeline-stage: v = num_layers / (pp * this)."""
    recompute: str | None = None
    sequence_parallel: bool | None = None
    distributed_optimizer: bool | None = None
    """--use-distributed-optimizer: True means sharding ``optim``, False ``no_shard`` (``sharding`` wins)."""
    cp: int | None = None
    """--context-parallel-size."""
    sharding: str | None = None
    """--data-parallel-sharding-strategy."""
    cp_comm_type: str | None = None
    """--cp-comm-type (None: p2p, not searched)."""
    layer_split: tuple[int, ...] | None = None
    """Megatron-style explicit layers per pipeline stage (--pipeline-layer-split): fixes pp and v = 1."""
    first_layers: int | None = None
    """--decoder-first-pipeline-num-layers: the first stage's layers (v = 1; the other stages split
    the rest evenly). With ``last_layers`` None too, the search picks the split itself."""
    last_layers: int | None = None
    """--decoder-last-pipeline-num-layers: the last stage's layers."""
    accounting: tuple[bool, bool] | None = None
    """(embedding, loss) counted as layers of the split (--account-for-embedding/loss-in-pipeline-split):
    with one True only such splits are planned (v = 1 and interleaved); both False: none of them;
    None: searched."""


@dataclass
class SearchResult:
    """Fitting plans ranked fastest first, and every rejected plan with the rule it broke."""

    plans: list[Plan]
    rejected: list[tuple[Plan, Rejection]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the search left out and why (each once), e.g. interleaving where the layers do not split evenly."""

    @property
    def evaluated(self) -> int:
        return len(self.plans) + len(self.rejected)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(
    model: ModelSpec,
    layout: Layout,
    cluster: Cluster,
    *,
    constants=DEFAULT_CONSTANTS,
    overhead_bytes: float | None = None,
) -> tuple[Plan, Rejection | None]:
    """Predict one layout: rules, then memory, then (if it fits) time. Returns the plan and the
    first rejection (None when it fits)."""
    broken = all_rejections(model, layout, cluster)
    if broken:
        return Plan(layout, False, reasons=[r.message for r in broken]), broken[0]
    return _predict(model, layout, cluster, constants, overhead_bytes)


def _predict(model, layout, cluster, constants, overhead_bytes) -> tuple[Plan, Rejection | None]:
    kwargs = {} if overhead_bytes is None else {"overhead_bytes": overhead_bytes}
    memory = memory_breakdown(model, layout, cluster.gpu, **kwargs)
    capacity = cluster.gpu.memory_bytes
    if memory.total > capacity:
        largest = max(("params", "grads", "optimizer", "activations"), key=lambda k: getattr(memory, k))
        digits = 2 if f"{memory.total / GiB:.2f}" != f"{capacity / GiB:.2f}" else 4
        message = (
            f"memory {memory.total / GiB:.{digits}f} GiB > {capacity / GiB:.{digits}f} GiB on stage "
            f"{memory.stage} ({largest} {getattr(memory, largest) / GiB:.1f} GiB)"
        )
        return Plan(layout, False, memory=memory, reasons=[message]), Rejection("memory", message)
    perf = evaluate_performance(model, layout, cluster, constants)
    return Plan(layout, True, memory, perf.time, perf.tflops_per_gpu / TFLOPS, perf.mfu), None


def _options(fixed_value, choices):
    return [fixed_value] if fixed_value is not None else choices


def search(
    model: ModelSpec,
    cluster: Cluster,
    global_batch_size: int,
    *,
    fixed: Fixed = Fixed(),
    precision: str = "bf16",
    constants=DEFAULT_CONSTANTS,
    overhead_bytes: float | None = None,
) -> SearchResult:
    """Every layout of ``cluster.num_gpus`` GPUs for ``model`` at ``global_batch_size``, predicted."""
    result = SearchResult([])
    args = (model, cluster, global_batch_size, fixed, precision, constants, overhead_bytes, result)
    if fixed.cp is not None:
        _search_cp(*args, cps=(fixed.cp,))
    else:
        _search_cp(*args, cps=(1,))
        if model.seq_length >= CP_MIN_SEQ_LENGTH or not result.plans:
            _search_cp(
                *args,
                cps=tuple(
                    c
                    for c in divisors(cluster.num_gpus)[1:]
                    if model.seq_length % (2 * c) == 0 and model.seq_length // c >= CP_MIN_LOCAL_TOKENS
                ),
            )
    result.plans.sort(key=lambda p: p.need_time().step)
    return result


def _search_cp(model, cluster, big_b, fixed, precision, constants, overhead, result, *, cps) -> None:
    """Every tp x cp x pp x dp layout with cp in ``cps`` (tp, then cp inside the node next to it)."""
    n = cluster.num_gpus
    fixed_pp = len(fixed.layer_split) if fixed.layer_split is not None else fixed.pp
    for tp in _options(fixed.tp, divisors(n)):
        for cp in cps:
            if n % (tp * cp):
                continue
            for pp in _options(fixed_pp, divisors(n // (tp * cp))):
                if n % (tp * cp * pp) or (fixed.dp is not None and fixed.dp * tp * cp * pp != n):
                    continue
                dp = n // (tp * cp * pp)
                micro = fixed.micro_batch_size if fixed.micro_batch_size is not None or cp == 1 else 1
                for b in _micro_batches(big_b, dp, micro):
                    _search_layout(
                        model, cluster, tp, pp, dp, b, big_b, fixed, precision, constants, overhead, result, cp=cp
                    )


def _interleaving_flag_errors(
    num_layers: int, tp: int, pp: int, dp: int, b: int, big_b: int, per_chunk: int
) -> list[str]:
    """``--num-layers-per-virtual-pipeline-stage`` makes ``ptdp train`` run the interleaved schedule
    whatever v it gives (v = 1 included): that schedule's rules, as ``ptdp train`` checks them."""
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        pipeline_schedule="interleaved-1f1b",
        num_layers_per_virtual_pipeline_stage=per_chunk,
    )
    return [v.message for v in schedule_violations(parallel, num_layers, big_b // (b * dp))]


def _fixed_split(num_layers: int, pp: int, fixed: Fixed) -> tuple[tuple[int, ...] | None, bool, tuple[Rejection, ...]]:
    """(the split the user fixed or None, whether the search picks the split, the rejection of fixed
    first/last counts that cannot split ``num_layers`` over ``pp`` stages)."""
    if fixed.accounting is not None and any(fixed.accounting):
        try:
            return accounted_split(num_layers, pp, embedding=fixed.accounting[0], loss=fixed.accounting[1]), False, ()
        except ConfigError as e:
            return None, False, (Rejection("layers % pp", str(e)),)
    if fixed.first_layers is None and fixed.last_layers is None:
        return fixed.layer_split, fixed.layer_split is None and pp > 1, ()
    try:
        return first_last_split(num_layers, pp, fixed.first_layers, fixed.last_layers), False, ()
    except ConfigError as e:
        return None, False, (Rejection("layers % pp", str(e)),)


def _predict_split(model, layout, cluster, constants, overhead, search_split: bool) -> tuple[Plan, Rejection | None]:
    """Predict ``layout``; with ``search_split`` try the splits of :func:`candidate_splits` (from the
    edge work of :func:`edge_layer_equivalents`) and return the fastest that fits, else the one
    closest to fitting (the even split first: it wins ties). When the even split fits, an uneven
    one whose busiest stage is no lighter (layers + edge work) is not predicted: its m slots are
    no shorter."""
    if not search_split:
        return _predict(model, layout, cluster, constants, overhead)
    if _no_split_fits(model, layout, cluster, overhead):  # the even (or first) split stands for all
        split = next(iter(candidate_splits(model.num_layers, layout.pp, 0.0, 0.0)), None)
        return _predict(model, dataclasses.replace(layout, layer_split=split), cluster, constants, overhead)
    first, last = edge_layer_equivalents(model, layout, cluster, constants)
    load = lambda s: max(s[0] + first, s[-1] + last, *s[1:-1])  # noqa: E731 - busiest stage, in layers
    best, even_load = None, None
    for split in candidate_splits(model.num_layers, layout.pp, first, last):
        if split is not None and even_load is not None and load(split) >= even_load:
            continue
        plan, rejection = _predict(model, dataclasses.replace(layout, layer_split=split), cluster, constants, overhead)
        if split is None and rejection is None:
            even_load = load((model.num_layers // layout.pp,) * layout.pp)
        key = (0, plan.need_time().step) if rejection is None else (1, plan.memory.total if plan.memory else 0.0)
        if best is None or key < best[0]:
            best = (key, plan, rejection)
    if best is None:  # no split balances the edge work within one layer of the middle stages
        message = (
            f"num_layers={model.num_layers} has no balanced split over pp={layout.pp} stages (the first "
            f"and last stages also carry the embedding and the output layer + loss, {first:.1f} and "
            f"{last:.1f} layers' worth; rule: each stage >= 1 layer, the first and last at most one "
            f"layer above the middle ones); give --pipeline-layer-split to plan a split of your own"
        )
        return Plan(layout, False, reasons=[message]), Rejection("layers % pp", message)
    return best[1], best[2]


def _no_split_fits(model, layout: Layout, cluster, overhead) -> bool:
    """True when no split of the layers can fit: the mean stage's state bytes (a lower bound of the
    most loaded stage's, :func:`~ptdp.planner.memory.mean_stage_params`; transients, activations
    and FP8 copies left out) and the overhead already exceed the GPU."""
    per_param = sum(strategy_bytes_per_param(layout.precision, layout.sharding_strategy, layout.shard_size))
    floor = mean_stage_params(model, layout.tp, layout.pp) * per_param
    return floor + (DEFAULT_OVERHEAD_BYTES if overhead is None else overhead) > cluster.gpu.memory_bytes


def _micro_batches(big_b: int, dp: int, fixed: int | None) -> list[int]:
    if fixed is not None:
        return [fixed]
    if big_b % dp:
        return [1]  # rejected by the batch rule, reported once
    return [b for b in divisors(big_b // dp) if b <= MAX_MICRO_BATCH]


def _strategies(fixed: Fixed, shard: int) -> list[str]:
    """Sharding strategies to try, least sharded first (see the module docstring's pruning)."""
    if shard == 1:
        return ["no_shard"]
    if fixed.sharding is not None:
        return [fixed.sharding]
    if fixed.distributed_optimizer is not None:
        return ["optim" if fixed.distributed_optimizer else "no_shard"]
    return list(SHARDING)


def _sharding_cannot_fit(unsharded: Plan, layout: Layout, cluster) -> bool:
    """True when ``unsharded`` (the no_shard plan that did not fit) would not fit even with every
    state byte sharded: its most loaded stage's ``n`` parameters (its float32 gradients / 4) keep
    at least ``n (w + g + k) / (dp cp)`` bytes of state under optim_grads_params, besides the
    same activations and overhead (a lower bound: transients and FP8 copies left out)."""
    mem = unsharded.memory
    if mem is None:
        return False
    n = mem.grads / 4.0
    floor = sum(strategy_bytes_per_param(layout.precision, "optim_grads_params", layout.shard_size)) * n
    return mem.activations + mem.overhead + floor > cluster.gpu.memory_bytes


def _predict_strategies(
    model, make, strategies: list[str], cluster, constants, overhead, search_split: bool, result: SearchResult
) -> None:
    """Predict the layout ``make(strategy)`` gives under ``strategies`` (least sharded first) and
    record it: no_shard first; when it fits, optim too (never slower, less memory); when it does
    not, the sharded ones in order up to the first that fits, unless even full sharding cannot
    fit (:func:`_sharding_cannot_fit`); and optim_grads whenever it reduces chunk by chunk
    (:func:`~ptdp.planner.sharding.chunk_by_chunk`: then it can be faster than optim). Kept: every
    fitting no_shard, the first fitting sharded strategy, and a fitting chunk-by-chunk optim_grads."""
    first = make(strategies[0])
    bad = schedule_rejections(model, first)  # the same for every strategy
    if bad:
        result.rejected.append((Plan(first, False, reasons=[r.message for r in bad]), bad[0]))
        return
    outcomes = {}

    def fits(strategy: str) -> bool:
        layout = first if strategy == strategies[0] else make(strategy)
        outcomes[strategy] = _predict_split(model, layout, cluster, constants, overhead, search_split)
        return outcomes[strategy][1] is None

    if fits(strategies[0]):
        if len(strategies) > 1:
            fits(strategies[1])
    elif len(strategies) > 1 and not _sharding_cannot_fit(outcomes[strategies[0]][0], first, cluster):
        next((s for s in strategies[1:] if fits(s)), None)
    by_chunk = "optim_grads" in strategies and chunk_by_chunk(
        "optim_grads", first.shard_size, first.virtual_stages, first.num_microbatches, first.pp
    )
    if by_chunk and "optim_grads" not in outcomes:  # may be faster than optim: one chunk's reduction exposed
        fits("optim_grads")
    kept_sharded = False
    for strategy in strategies:
        if strategy not in outcomes:
            continue
        plan, rejection = outcomes[strategy]
        if rejection is not None:
            result.rejected.append((plan, rejection))
        elif strategy == "no_shard" or not kept_sharded or (by_chunk and strategy == "optim_grads"):
            result.plans.append(plan)
            kept_sharded = strategy != "no_shard"


def _search_layout(
    model, cluster, tp, pp, dp, b, big_b, fixed, precision, constants, overhead, result, *, cp: int = 1
) -> None:
    split, search_split, broken = _fixed_split(model.num_layers, pp, fixed)
    probe = next(iter(candidate_splits(model.num_layers, pp, 0.0, 0.0)), None) if search_split else split
    broken = broken or structural_rejections(
        model, tp, pp, dp, b, big_b, cluster.gpus_per_node, probe
    ) + context_rejections(model, tp, cp)
    base = Layout(tp, pp, dp, b, big_b, precision=precision, layer_split=split, cp=cp)
    if broken:
        result.rejected.append((Plan(base, False, reasons=[r.message for r in broken]), broken[0]))
        return
    if split is not None:
        vs = [1]
    elif fixed.virtual_stages is not None:
        vs = [fixed.virtual_stages]
    elif fixed.layers_per_virtual_stage is not None:
        flag_errors = _interleaving_flag_errors(model.num_layers, tp, pp, dp, b, big_b, fixed.layers_per_virtual_stage)
        if flag_errors:
            result.rejected.append((Plan(base, False, reasons=flag_errors), Rejection("interleaving", flag_errors[0])))
            return
        vs = [model.num_layers // (pp * fixed.layers_per_virtual_stage)]
    elif pp > 1 and model.num_layers % pp == 0:
        vs = divisors(model.num_layers // pp)
    else:
        vs = [1]
    pairs: list[tuple[int, tuple[int, ...] | None]] = [
        (v, None) for v in vs
    ]  # (v, the split of an interleaved layout, None: as above)
    counted = fixed.accounting
    if counted is not None and any(counted):  # the split fixed by what counts as layers, at every v
        pairs = [(1, None)] if fixed.virtual_stages in (None, 1) else []
        pairs += [
            (v, s)
            for v, s in interleaved_splits(model.num_layers, pp, (counted,), uneven_only=False)
            if fixed.virtual_stages in (None, v)
        ]
    elif search_split and fixed.layers_per_virtual_stage is None:
        pairs += [
            (v, s)
            for v, s in interleaved_splits(model.num_layers, pp, ACCOUNTING if counted is None else ())
            if fixed.virtual_stages in (None, v) and (v not in vs or model.num_layers % (pp * v))
        ]
    if pp > 1 and model.num_layers % pp and search_split:
        result.note(
            f"pp={pp}: {model.num_layers} layers do not split evenly over {pp} stages: planned with "
            f"uneven first/last stages (v = 1) and interleaved only where the embedding and/or loss "
            f"counted as layers split evenly over pp*v model chunks (ptdp train runs both)"
        )
    for v, v_split in pairs:
        # with a flash kernel selective recompute keeps and costs what "none" does: not searched
        searched = [r for r in RECOMPUTE if not (r == "selective" and model.flash_attention)]
        for recompute in _options(fixed.recompute, searched):
            # sequence parallelism needs tp > 1 and sharding dp * cp > 1: off otherwise
            for sp in _options(fixed.sequence_parallel, [False, True]) if tp > 1 else [False]:

                def make(sharding, v=v, recompute=recompute, sp=sp, v_split=v_split):
                    return Layout(
                        tp,
                        pp,
                        dp,
                        b,
                        big_b,
                        v,
                        recompute,
                        sp,
                        precision=precision,
                        layer_split=v_split or split,
                        cp=cp,
                        sharding=sharding,
                        cp_comm_type=fixed.cp_comm_type or "p2p",
                    )

                _predict_strategies(
                    model,
                    make,
                    _strategies(fixed, dp * cp),
                    cluster,
                    constants,
                    overhead,
                    search_split and v == 1 and v_split is None,
                    result,
                )
