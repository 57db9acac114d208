"""Search every valid layout for a model on a cluster, predict each, rank by step time.

The search enumerates tp x cp x pp x dp = number of GPUs, micro batch size, virtual pipeline
stages, the pipeline schedule (:func:`_schedules`: the zero-bubble ones ``ptdp train`` runs beside
1f1b and interleaved-1f1b), recompute, sequence parallelism, the sharding strategy and the pipeline
split (:mod:`ptdp.planner.splits`); any of them can be fixed. Pruning: cp > 1 only from
:data:`CP_MIN_SEQ_LENGTH` tokens (or when nothing fits with cp = 1), with ``seq_length % (2 cp) == 0``,
at least :data:`CP_MIN_LOCAL_TOKENS` per rank and micro batch 1; sharding strategies as
:func:`ptdp.planner.search.predict.predict_strategies` says. Layouts that break a rule
(:mod:`ptdp.planner.search.rules`, the rules ``ptdp train`` checks) or do not fit in memory are
kept as rejected plans with their reasons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ptdp.config import fields
from ptdp.config.fields import SHARDING_STRATEGIES
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules.layout import schedule_violations
from ptdp.errors import ConfigError, Violation
from ptdp.layout.pipeline.partition import accounted_split, first_last_split
from ptdp.layout.pipeline.placement import V_SCHEDULES, placement_of
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS
from ptdp.planner.candidate import RECOMPUTE, Candidate, Plan
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.inputs.moe_model import moe_of
from ptdp.planner.memory.moe_params import expert_param_count
from ptdp.planner.memory.strategies import strategy_bytes_per_param
from ptdp.planner.search.predict import predict_strategies
from ptdp.planner.search.ranking import Pending, RankedPlans
from ptdp.planner.search.rules import (
    context_rejections,
    expert_rejections,
    structural_rejections,
    trains_schedule,
)
from ptdp.planner.splits import ACCOUNTING, candidate_splits, interleaved_splits
from ptdp.planner.time.constants import DEFAULT_CONSTANTS

__all__ = ["MAX_MICRO_BATCH", "Fixed", "SearchResult", "divisors", "search"]

MAX_MICRO_BATCH = 32
#: Search cp > 1 only from this sequence length on (or when no layout fits without it): shorter
#: sequences split into 2 cp chunks make GEMMs thinner and add key/value traffic for activation
#: memory that recompute or more tp/pp can save instead. Llama 3 (§3.3.2) used cp only for its
#: long-context stage; 16K is a round threshold, not fitted.
CP_MIN_SEQ_LENGTH = 16384
#: Search cp only while each rank keeps at least this many tokens (``s / cp``): a ring step's
#: attention work falls with the square of the block length, its transfer only linearly, so
#: ever smaller blocks cannot hide their exchange. A pruning bound, not fitted.
CP_MIN_LOCAL_TOKENS = 1024


@dataclass(frozen=True)
class Fixed:
    """The settings of a ``ptdp plan`` request the user fixed, by their schema names (the fields of
    :class:`~ptdp.config.parallel.ParallelConfig`, ``micro_batch_size`` and
    ``recompute_granularity``); None means "search it" (or, for the data-parallel engine's options,
    ``ptdp train``'s default)."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    data_parallel_size: int | None = None
    context_parallel_size: int | None = None
    micro_batch_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    recompute_granularity: str | None = None
    sequence_parallel: bool | None = None
    use_distributed_optimizer: bool | None = None
    data_parallel_sharding_strategy: str | None = None
    cp_comm_type: str | None = None
    pipeline_layer_split: tuple[int, ...] | None = None
    """Explicit layers per pipeline stage: fixes pp and v = 1."""
    decoder_first_pipeline_num_layers: int | None = None
    """The first stage's layers (v = 1; the other stages split the rest evenly). With the last
    stage's None too, the search picks the split itself."""
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool | None = None
    account_for_loss_in_pipeline_split: bool | None = None
    ddp_bucket_size: int | None = None
    overlap_grad_reduce: bool | None = None
    reshard_after_forward: bool | None = None
    grad_reduce_in_bf16: bool | None = None
    fp8_param_gather: bool | None = None
    """FP8 weights (``--fp8-param-gather``, planner only)."""
    recompute_modules: tuple[str, ...] | None = None
    """Megatron-Core's ``--recompute-modules`` with selective recompute (planner only)."""
    use_precision_aware_optimizer: bool | None = None
    main_params_dtype: str | None = None
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    """The optimizer state's dtypes with ``--use-precision-aware-optimizer`` (planner only)."""
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None
    moe_token_dispatcher_type: str | None = None
    fp8_recipe: str | None = None
    """``ptdp train``'s FP8 recipe planned with precision fp8 (None: Transformer Engine's, or no FP8)."""
    pipeline_schedule: str | None = None
    """The pipeline schedule (None: the one v implies and the zero-bubble ones, :func:`_schedules`)."""

    @property
    def optimizer_dtypes(self) -> tuple[str, str, str]:
        """(main parameters, first moment, second moment) dtypes; fp32 where not given."""
        return (self.main_params_dtype or "fp32", self.exp_avg_dtype or "fp32", self.exp_avg_sq_dtype or "fp32")

    @property
    def tp(self) -> int | None:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int | None:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int | None:
        return self.data_parallel_size

    @property
    def cp(self) -> int | None:
        return self.context_parallel_size

    @property
    def sharding_strategy(self) -> str | None:
        """The sharding strategy fixed: the strategy, else ``optim`` / ``no_shard`` for
        ``use_distributed_optimizer`` True / False, else None (searched)."""
        if self.data_parallel_sharding_strategy is not None or self.use_distributed_optimizer is None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def interleaved(self) -> bool:
        """Model chunks are asked for: layers per chunk, or v > 1 (as :attr:`ParallelConfig.interleaved
        <ptdp.config.parallel.ParallelConfig.interleaved>`)."""
        return bool(self.num_layers_per_virtual_pipeline_stage) or (self.virtual_pipeline_model_parallel_size or 1) > 1

    @property
    def accounting(self) -> tuple[bool, bool] | None:
        """(embedding, loss) counted as layers of the split: with one True only such splits are
        planned (v = 1 and interleaved); both False: none of them; None (neither given): searched."""
        given = (self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split)
        return None if given == (None, None) else (bool(given[0]), bool(given[1]))


@dataclass
class SearchResult:
    """Fitting plans ranked fastest first (:class:`~ptdp.planner.search.ranking.RankedPlans` from a
    search), and every rejected plan with the rule it broke."""

    plans: Sequence[Plan]
    rejected: list[tuple[Plan, Violation]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the search left out and why (each once), e.g. interleaving where the layers do not split evenly."""
    uneven_pp: list[int] = field(default_factory=list, repr=False)
    """The pipeline sizes whose stages the layers do not split evenly (one note names them all)."""
    found: list[Plan | Pending] = field(default_factory=list, repr=False)
    """The fitting plans while the search runs, in the order found (ranked into ``plans`` at its end)."""

    @property
    def evaluated(self) -> int:
        return len(self.plans) + len(self.rejected)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def note_uneven(self, num_layers: int, pp: int) -> None:
        """One note for every pp whose stages ``num_layers`` layers do not split evenly."""
        if pp in self.uneven_pp:
            return
        old = self._uneven_note(num_layers) if self.uneven_pp else None
        self.uneven_pp.append(pp)
        if old in self.notes:
            self.notes[self.notes.index(old)] = self._uneven_note(num_layers)
        else:
            self.notes.append(self._uneven_note(num_layers))

    def _uneven_note(self, num_layers: int) -> str:
        sizes = ", ".join(str(pp) for pp in self.uneven_pp)
        return (
            f"{num_layers} layers do not split evenly over pp = {sizes} stages: planned with uneven "
            f"first/last stages (v = 1) and interleaved only where the embedding and/or loss counted as "
            f"layers split evenly over pp*v model chunks (ptdp train runs both)"
        )


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending (trial division up to its square root)."""
    return list(_divisors(n))


def _options(fixed_value, choices):
    return [fixed_value] if fixed_value is not None else choices


def search(
    model: ModelConfig,
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
        if model.seq_length >= CP_MIN_SEQ_LENGTH or not result.found:
            _search_cp(
                *args,
                cps=tuple(
                    c
                    for c in divisors(cluster.num_gpus)[1:]
                    if model.seq_length % (2 * c) == 0 and model.seq_length // c >= CP_MIN_LOCAL_TOKENS
                ),
            )
    result.plans = RankedPlans(result.found)
    result.found = []
    return result


def _search_cp(model, cluster, big_b, fixed, precision, constants, overhead, result, *, cps) -> None:
    """Every tp x cp x pp x dp layout with cp in ``cps`` (tp, then cp inside the node next to it)."""
    n = cluster.num_gpus
    fixed_pp = len(fixed.pipeline_layer_split) if fixed.pipeline_layer_split is not None else fixed.pp
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


def _fixed_split(num_layers: int, pp: int, fixed: Fixed) -> tuple[tuple[int, ...] | None, bool, tuple[Violation, ...]]:
    """(the split the user fixed or None, whether the search picks the split, the rejection of fixed
    first/last counts that cannot split ``num_layers`` over ``pp`` stages)."""
    if fixed.accounting is not None and any(fixed.accounting):
        try:
            return accounted_split(num_layers, pp, embedding=fixed.accounting[0], loss=fixed.accounting[1]), False, ()
        except ConfigError as e:
            return None, False, (Violation("layers % pp", str(e)),)
    if fixed.decoder_first_pipeline_num_layers is None and fixed.decoder_last_pipeline_num_layers is None:
        return fixed.pipeline_layer_split, fixed.pipeline_layer_split is None and pp > 1, ()
    try:
        return (
            first_last_split(
                num_layers, pp, fixed.decoder_first_pipeline_num_layers, fixed.decoder_last_pipeline_num_layers
            ),
            False,
            (),
        )
    except ConfigError as e:
        return None, False, (Violation("layers % pp", str(e)),)


def expert_grids(
    model: ModelConfig, tp: int, cp: int, pp: int, dp: int, fixed: Fixed, cluster: Cluster, precision: str
) -> list[tuple[int, int]]:
    """The (ep, etp) pairs searched for a layout of ``tp x cp x dp`` ranks per stage: those fixed;
    for a dense model (1, 1) unless fixed (then refused by the rules); else etp 1 or tp, and for each
    the ep dividing the experts with ``ep etp`` dividing ``tp cp dp`` (the expert grid folds over
    the same ranks) whose routed experts' own state fits the GPU (:func:`expert_state_floor`), of
    which: 1; the largest whose group stays in a node (a smaller one holds more experts in smaller
    groups over the same links); and the three smallest beyond a node (each doubling sends a larger
    share of the tokens over the network). etp > 1 only with ep = E: otherwise ep x etp as the ep
    holds as many expert weights per rank, each whole, in fuller GEMMs and without the etp exchange.
    Always at least one pair (refused by the rules or memory when none fits)."""
    moe = moe_of(model)
    if moe is None:
        return [(fixed.expert_model_parallel_size or 1, fixed.expert_tensor_parallel_size or 1)]
    per_stage = tp * cp * dp
    etps = _options(fixed.expert_tensor_parallel_size, sorted({1, tp}))
    eps = _options(fixed.expert_model_parallel_size, divisors(moe.num_experts or 1))
    pairs = [(ep, etp) for etp in etps for ep in eps if per_stage % (ep * etp) == 0]
    if not pairs:  # nothing divides: the first fixed or searched pair, refused by the rules
        return [(eps[0], etps[0])]
    if fixed.expert_model_parallel_size is not None:
        return pairs
    capacity, node, experts = cluster.gpu.memory_bytes, cluster.gpus_per_node, moe.num_experts or 1
    kept = []
    for etp in etps:
        fit = [
            ep
            for ep, t in pairs
            if t == etp and expert_state_floor(model, tp, cp, pp, dp, ep, etp, precision) <= capacity
        ]
        if etp > 1 and fixed.expert_tensor_parallel_size is None:
            fit = [ep for ep in fit if ep == experts]  # else ep x etp as ep: the same experts per rank, whole
        inside = [ep for ep in fit if ep * etp <= node]
        beyond = [ep for ep in fit if ep * etp > node]
        chosen = {ep for ep in inside if ep in (1, max(inside))} | set(beyond[:3])
        kept += [(ep, etp) for ep in sorted(chosen)]
    return kept or pairs[-1:]


def expert_state_floor(
    model: ModelConfig, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int, precision: str
) -> float:
    """Bytes the routed experts of the busiest stage keep on a rank whatever else: weights and
    gradients whole, the Adam state over edp (ZeRO-1), for ``ceil(MoE layers / pp)`` layers of
    ``E / ep`` experts over etp; a lower bound of the rank's memory."""
    moe = moe_of(model)
    if moe is None:
        return 0.0
    layers = -(-len(model.moe_layer_ids) // pp)  # type: ignore[attr-defined]
    n = layers * (moe.num_experts or 0) // ep * expert_param_count(model, moe, etp)
    edp = max(1, tp * cp * dp // (ep * etp))
    return n * sum(strategy_bytes_per_param(precision, "optim", edp))


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
    if fixed.sharding_strategy is not None:
        return [fixed.sharding_strategy]
    return list(SHARDING_STRATEGIES)


def _virtual_stage_pairs(
    model: ModelConfig, tp: int, pp: int, dp: int, b: int, big_b: int, fixed: Fixed, split, search_split: bool
) -> tuple[list[tuple[int, tuple[int, ...] | None]], list[str]]:
    """((v, the split of an interleaved layout or None) pairs to plan, the flag errors that reject
    them all): the v the user fixed (directly or by layers per virtual stage), else the v a fixed
    schedule runs with (:func:`_schedule_chunks`), else every v whose chunks split the stage's
    layers evenly, plus the interleaved splits with the embedding and/or loss counted as layers
    (:func:`ptdp.planner.splits.interleaved_splits`) where that is searched or fixed."""
    if split is not None:
        vs = [1]
    elif fixed.pipeline_schedule is not None and fixed.virtual_pipeline_model_parallel_size is None:
        vs = _schedule_chunks(fixed.pipeline_schedule, model.num_layers, pp)
    elif fixed.virtual_pipeline_model_parallel_size is not None:
        vs = [fixed.virtual_pipeline_model_parallel_size]
    elif fixed.num_layers_per_virtual_pipeline_stage is not None:
        flag_errors = _interleaving_flag_errors(
            model.num_layers, tp, pp, dp, b, big_b, fixed.num_layers_per_virtual_pipeline_stage
        )
        if flag_errors:
            return [], flag_errors
        vs = [model.num_layers // (pp * fixed.num_layers_per_virtual_pipeline_stage)]
    elif pp > 1 and model.num_layers % pp == 0:
        vs = divisors(model.num_layers // pp)
    else:
        vs = [1]
    pairs: list[tuple[int, tuple[int, ...] | None]] = [(v, None) for v in vs]
    counted = fixed.accounting
    if counted is not None and any(counted):  # the split fixed by what counts as layers, at every v
        pairs = [(1, None)] if fixed.virtual_pipeline_model_parallel_size in (None, 1) else []
        pairs += [
            (v, s)
            for v, s in interleaved_splits(model.num_layers, pp, (counted,), uneven_only=False)
            if fixed.virtual_pipeline_model_parallel_size in (None, v)
        ]
    elif (
        search_split
        and fixed.num_layers_per_virtual_pipeline_stage is None
        and fixed.pipeline_schedule in (None, "interleaved-1f1b")
    ):
        pairs += [
            (v, s)
            for v, s in interleaved_splits(model.num_layers, pp, ACCOUNTING if counted is None else ())
            if fixed.virtual_pipeline_model_parallel_size in (None, v) and (v not in vs or model.num_layers % (pp * v))
        ]
    elif search_split and fixed.pipeline_schedule in V_SCHEDULES and model.num_layers % (2 * pp):
        # a fixed V schedule whose two chunks per rank do not split the layers: the embedding and/or
        # the loss counted as layers, as for interleaving
        pairs = [(v, s) for v, s in interleaved_splits(model.num_layers, pp, ACCOUNTING) if v == 2] or pairs
    return pairs, []


def _schedule_chunks(kind: str, num_layers: int, pp: int) -> list[int]:
    """The v a fixed schedule runs with, v not fixed: 2 on the V placement, v > 1 interleaved
    (each whose chunks split a stage's layers evenly; 2 when none does, rejected by the rules), else 1."""
    if placement_of(kind) == "v":
        return [2]
    if kind == "interleaved-1f1b":
        chunks = divisors(num_layers // pp)[1:] if pp > 1 and num_layers % pp == 0 else []
        return chunks or [2]
    return [1]


def _schedules(fixed: Fixed, pp: int, v: int, even: bool) -> list[str]:
    """The pipeline schedules planned for a layout of ``pp`` ranks with ``v`` model chunks each:
    the one fixed; else the one v implies (1f1b, interleaved-1f1b) and, with pp > 1, every
    schedule running B and W apart (:data:`~ptdp.layout.pipeline.schedule.SPLIT_ORDERS`) that
    ``ptdp train`` runs (:data:`ptdp.config.fields.SCHEDULES` less ``SCHEDULES_NOT_TRAINED``, read
    at each call) and whose chunks v is: zb-h1 and zb-h2 at v = 1, zb-v and dualpipev at v = 2
    (on the V placement) when the chunks split the layers evenly (``even``: no split of their own)."""
    if fixed.pipeline_schedule is not None:
        return [fixed.pipeline_schedule]
    out = ["1f1b" if v == 1 else "interleaved-1f1b"]
    if pp == 1:
        return out
    trained = [k for k in fields.SCHEDULES if k not in fields.SCHEDULES_NOT_TRAINED and k in SPLIT_ORDERS]
    for kind in trained:
        v_placement = placement_of(kind) == "v"
        if (v == 2 and v_placement and even) or (v == 1 and not v_placement):
            out.append(kind)
    return out


#: a schedule -> one keeping no more activations at the same layout (v = 1): a layout that does
#: not fit in memory under the second does not under the first either
HOLDS_NO_MORE = {"zb-h1": "1f1b", "zb-h2": "zb-h1"}


def _runnable(model: ModelConfig, make, strategies: list[str], kind: str, *, planned: bool) -> list[str]:
    """The sharding ``strategies`` under which ``ptdp train`` runs schedule ``kind``, the schedule of
    ``make(strategy)`` (:func:`~ptdp.planner.search.rules.trains_schedule`). A ``planned`` schedule
    (the one fixed, or the one v implies) keeps the first when it runs under none, to be rejected
    with the reason; another (a zero-bubble alternative) is left out when none runs it or the
    config's schedule rules refuse it."""
    runnable = [s for s in strategies if trains_schedule(kind, s, model.tied)]
    if planned:
        return runnable or strategies[:1]
    first = make(runnable[0]) if runnable else None
    if first is None or schedule_violations(first.parallel, model.num_layers, first.num_microbatches):
        return []
    return runnable


def _search_layout(
    model, cluster, tp, pp, dp, b, big_b, fixed, precision, constants, overhead, result, *, cp: int = 1
) -> None:
    """Predict the layouts of one (tp, cp, pp, dp, b): every (v, split) pair
    (:func:`_virtual_stage_pairs`), pipeline schedule (:func:`_schedules`), recompute granularity
    and sequence parallelism, each under its sharding strategies (those ``ptdp train`` runs the
    schedule with, :func:`_runnable`; :func:`ptdp.planner.search.predict.predict_strategies`), into
    ``result``."""
    split, search_split, broken = _fixed_split(model.num_layers, pp, fixed)
    probe = next(iter(candidate_splits(model.num_layers, pp, 0.0, 0.0)), None) if search_split else split
    broken = broken or structural_rejections(
        model, tp, pp, dp, b, big_b, cluster.gpus_per_node, probe
    ) + context_rejections(model, tp, cp)
    base = Candidate.of(
        tp, pp, dp, b, big_b, precision=precision, layer_split=split, cp=cp, fp8_recipe=fixed.fp8_recipe
    )
    if broken:
        result.rejected.append((Plan(base, False, reasons=[r.message for r in broken]), broken[0]))
        return
    pairs, flag_errors = _virtual_stage_pairs(model, tp, pp, dp, b, big_b, fixed, split, search_split)
    if flag_errors:
        result.rejected.append((Plan(base, False, reasons=flag_errors), Violation("interleaving", flag_errors[0])))
        return
    if pp > 1 and model.num_layers % pp and search_split:
        result.note_uneven(model.num_layers, pp)
    # with a flash kernel selective recompute keeps and costs what "none" does: not searched
    searched = [r for r in RECOMPUTE if not (r == "selective" and model.flash_attention)]
    if constants.cuda_graphs:  # Megatron-Core captures no graphs with full recompute
        searched = [r for r in searched if r != "full"]
    grids = expert_grids(model, tp, cp, pp, dp, fixed, cluster, precision)
    for (v, v_split), (ep, etp) in itertools.product(pairs, grids):
        kinds = _schedules(fixed, pp, v, v_split is None and split is None)
        over: dict[tuple[str, bool, str], dict[str, Plan]] = {}  # memory rejections by (recompute, sp, kind)
        hopeless: dict[tuple[str, bool, str], bool] = {}  # ... and whether no strategy could fit
        for recompute, kind in itertools.product(_options(fixed.recompute_granularity, searched), kinds):
            # sequence parallelism needs tp > 1 and sharding dp * cp > 1: off otherwise
            for sp in _options(fixed.sequence_parallel, [False, True]) if tp > 1 else [False]:
                made: dict[str, Candidate] = {}

                def make(
                    sharding, v=v, recompute=recompute, sp=sp, v_split=v_split, ep=ep, etp=etp, kind=kind, made=made
                ):
                    if sharding in made:
                        return made[sharding]
                    made[sharding] = Candidate.of(
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
                        ddp_bucket_size=fixed.ddp_bucket_size,
                        overlap_grad_reduce=fixed.overlap_grad_reduce is not False,
                        reshard_after_forward=fixed.reshard_after_forward is not False,
                        grad_reduce_in_bf16=bool(fixed.grad_reduce_in_bf16),
                        fp8_param_gather=bool(fixed.fp8_param_gather),
                        recompute_modules=tuple(fixed.recompute_modules or ()),
                        optimizer_dtypes=fixed.optimizer_dtypes,
                        ep=ep,
                        etp=etp,
                        dispatcher=fixed.moe_token_dispatcher_type or "alltoall",
                        fp8_recipe=fixed.fp8_recipe,
                        schedule=kind,
                    )
                    return made[sharding]

                dispatcher = fixed.moe_token_dispatcher_type or "alltoall"
                experts_broken = expert_rejections(model, tp, pp, tp * cp * pp * dp, ep, etp, sp, dispatcher)
                if experts_broken:  # the same under every schedule: reported with the planned one
                    if kind == kinds[0]:
                        reasons = [r.message for r in experts_broken]
                        result.rejected.append((Plan(make("no_shard"), False, reasons=reasons), experts_broken[0]))
                    continue
                strategies = _runnable(model, make, _strategies(fixed, dp * cp), kind, planned=kind == kinds[0])
                if not strategies:
                    continue
                lesser = (recompute, sp, HOLDS_NO_MORE.get(kind, ""))
                plans, rejected, none_fits = predict_strategies(
                    model,
                    make,
                    strategies,
                    cluster,
                    constants,
                    overhead,
                    search_split and v == 1 and v_split is None,
                    over.get(lesser),
                    hopeless.get(lesser, False),
                )
                over[(recompute, sp, kind)] = {
                    **over.get(lesser, {}),
                    **{p.layout.sharding_strategy: p for p, r in rejected if r.rule == "memory" and p.memory},
                }
                hopeless[(recompute, sp, kind)] = none_fits
                result.found += plans
                result.rejected += rejected
