"""What a rank holds on top of its shards with ``optim_grads`` and ``optim_grads_params``: the peak
of the full-size gradient buckets alive during a backward and of the gathered parameter units, in
elements per rank of one pipeline stage, as ptdp's engine allocates them
(:mod:`ptdp.engine.data_parallel.buffer`, :mod:`~ptdp.engine.data_parallel.units`).

Buckets are cut as :func:`ptdp.layout.buckets.chunk_buckets` does (back to front, at most ``bucket``
elements, never across two ZeRO-3 units, padded to a multiple of ``d = dp * cp``); a bucket is
allocated when backward reaches its parameters and, with ``overlap``, reduce-scattered when complete
(at most two in flight). Gathered units (resharded after forward) peak at two neighbours; kept
(``--no-reshard-after-forward``) every unit of the stage is gathered at once. Pure arithmetic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ptdp.config.model import ModelConfig
from ptdp.layout.buckets import chunk_buckets
from ptdp.planner.memory.chunk_params import (
    EMBED_UNIT,
    HEAD_UNIT,
    REST,
    TIED_UNIT,
    Chunk,
    _layer_params,
    chunk_params,
    layer_param_sizes,
)


def plan_buckets(
    params: tuple[tuple[int, int, int], ...], bucket: int, *, by_unit: bool, deferred: int | None
) -> tuple[tuple[int, ...], ...]:
    """The parameter indices of each bucket of one chunk (:func:`ptdp.layout.buckets.chunk_buckets`,
    the engine's plan; padding apart); ``deferred``: the index of the tied embedding kept alone."""
    units = [unit for _, _, unit in params] if by_unit else None
    alone = () if deferred is None else (deferred,)
    return tuple(chunk_buckets([n for n, _, _ in params], bucket, units=units, deferred=alone))


#: an event of a backward: the bucket indices allocated (a tuple), or the bucket started (an int)
Event = tuple[int, ...] | int


def _backward_events(params, buckets, deferred: int | None, order: list[int]) -> list[Event]:
    """The allocations and reduce-scatter launches (with overlap) of one backward of a chunk,
    its gradients completed in ``order`` (keys: bucket indices)."""
    of = {i: b for b, members in enumerate(buckets) for i in members}
    groups: dict[int, list[int]] = {}
    for i, (_, group, _) in enumerate(params):
        keys = groups.setdefault(group, [])
        if of[i] not in keys:
            keys.append(of[i])
    events: list[Event] = [tuple(groups.get(REST, []))]
    opened, missing = {REST}, {b: len(members) for b, members in enumerate(buckets)}
    for i in order:
        group = params[i][1]
        if group not in opened:
            opened.add(group)
            events.append(tuple(groups[group]))
        missing[of[i]] -= 1
        if missing[of[i]] == 0 and i != deferred:
            events.append(of[i])
    return events


@lru_cache(maxsize=4096)
def _allocation_states(
    model: ModelConfig,
    tp: int,
    split: bool,
    bucket: int,
    by_unit: bool,
    divisible_by: int,
    main_grad: bool,
    run: tuple[Chunk, ...],
    experts: bool = False,
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Replay the backwards of the chunks of ``run`` in order, no flush between them: after each
    allocation (where ``GradBuffer.peak_live_bytes`` is counted) the unpadded elements alive and
    those of each alive bucket, largest first; a launch with two in flight first lands (frees)
    the oldest. Which buckets are alive does not depend on the shard size, only their padding."""
    plans = [_chunk_plan(model, tp, split, c, bucket, by_unit, divisible_by, main_grad, experts) for c in run]
    alive: list[dict[int, int]] = [{} for _ in plans]  # slot -> bucket -> unpadded elements
    launched: list[tuple[int, int]] = []
    live = 0
    states = []
    for slot, plan in enumerate(plans):
        here = alive[slot]
        for event in plan.events:
            if isinstance(event, tuple):
                for b in event:
                    if b not in here:
                        here[b] = plan.raw[b]
                        live += plan.raw[b]
                states.append((live, tuple(n for slot_alive in alive for n in slot_alive.values())))
                continue
            if len(launched) == 2:  # never more than two in flight
                old_slot, old = launched.pop(0)
                live -= alive[old_slot].pop(old)
            launched.append((slot, event))
    return tuple(sorted(set(states), reverse=True))


def _in_flight(plan: _Plan, overlap: bool) -> tuple[int, ...]:
    """Chunk by chunk: the buckets of ``plan``'s chunk still in flight after its gradient was
    reduce-scattered: the last two started, those started during its last backward (with
    ``overlap``) and then the others in bucket order (``GradBuffer.chunk_done``)."""
    started = [event for event in plan.events if not isinstance(event, tuple)] if overlap else []
    rest = [b for b in range(len(plan.buckets)) if b not in set(started)]
    return tuple((started + rest)[-2:])


def _padded_peak(states: tuple[tuple[int, tuple[int, ...]], ...], d: int) -> int:
    """The most elements alive at once once every bucket is padded to a multiple of ``d``
    (:func:`_allocation_states`; states that cannot win even fully padded are skipped)."""
    most = max(len(sizes) for _, sizes in states)
    best = 0
    for raw, sizes in states:
        if raw + most * (d - 1) <= best:
            break
        best = max(best, raw + sum((-n) % d for n in sizes))
    return best


def _ready_order(
    model: ModelConfig, tp: int, params, word: int | None, main_grad: bool = False, experts: bool = False
) -> list[int]:
    """Parameter indices of a chunk (:func:`chunk_params`) in the order a backward completes
    their gradients: the head's back to front, each layer's as :func:`_layer_params` says from
    the last layer to the first, then the others back to front, the looked-up word embedding
    (index ``word``) last, after the position table (the two sum into the chunk's input: the
    table's gradient is accumulated before backward enters the lookup)."""
    places = [place for _, place in _layer_params(model, tp, main_grad, experts)]
    by_place = sorted(range(len(places)), key=places.__getitem__)  # a layer's positions, in completion order
    layer_index: dict[int, list[int]] = {}
    for i, (_, group, _) in enumerate(params):
        if group >= 0:
            layer_index.setdefault(group, []).append(i)
    after_layers = max((i for ids in layer_index.values() for i in ids), default=-1)
    head = [i for i in reversed(range(len(params))) if i > after_layers and i != word]
    layers = [layer_index[k][j] for k in sorted(layer_index, reverse=True) for j in by_place]
    done = set(head) | set(layers) | ({word} if word is not None else set())
    rest = [i for i in reversed(range(len(params))) if i not in done]
    return head + layers + rest + ([word] if word is not None else [])


#: layers per chunk simulated when every layer's buckets are cut alike (:func:`rank_transients`)
PERIODIC_LAYERS = 4


@lru_cache(maxsize=4096)
def rank_transients(
    model: ModelConfig,
    tp: int,
    pp: int,
    chunks: tuple[Chunk, ...],
    d: int,
    bucket: int,
    *,
    overlap: bool,
    params_sharded: bool,
    reshard: bool = True,
    divisible_by: int = 128,
    by_chunk: bool = False,
    main_grad: bool = False,
    rounds: int = 1,
    whole_step: bool = False,
    experts: bool = False,
) -> tuple[int, int]:
    """(gathered parameter elements, gradient bucket elements) at their peaks on one rank holding
    ``chunks`` (its model chunks in order), sharded over ``d`` ranks with ``bucket``-element buckets;
    the first is 0 unless ``params_sharded`` (``optim_grads_params``).

    Without ``overlap`` a chunk's buckets are all alive at the end of its backward; with it the backwards
    are replayed. Where every layer's buckets are cut alike, a chunk of :data:`PERIODIC_LAYERS` layers is
    replayed and the totals extended per layer (exact). ``main_grad``: 16-bit weights with fp32 main
    gradients; ``by_chunk``: reduced chunk by chunk, once per round of the interleaved schedule (``GradBuffer.by_chunk``);
    with ``rounds`` > 1 the last chunk's next round also follows the first chunk's reduction;
    ``whole_step`` (B and W apart): every chunk's buckets alive at once.
    """
    periodic = params_sharded or max(layer_param_sizes(model, tp, experts)) >= bucket
    short = chunks
    if periodic and any(c.layers > PERIODIC_LAYERS + 1 for c in chunks):
        short = tuple(dataclasses.replace(c, layers=min(c.layers, PERIODIC_LAYERS)) for c in chunks)
    split = pp > 1  # all a chunk's plan needs of pp (the tied copy)
    args = (bucket, params_sharded, divisible_by, main_grad, experts)
    plan = {c: _chunk_plan(model, tp, split, c, *args) for c in set(short)}
    padded = {c: sum(n + (-n) % d for n in p.raw) for c, p in plan.items()}  # each kind of chunk once
    totals = [padded[c] for c in short]
    if short != chunks:
        longer = [dataclasses.replace(c, layers=min(c.layers, PERIODIC_LAYERS + 1)) for c in chunks]
        more = {c: sum(n + (-n) % d for n in _chunk_plan(model, tp, split, c, *args).raw) for c in set(longer)}
        totals = [t + (c.layers - s.layers) * (more[m] - t) for c, s, t, m in zip(chunks, short, totals, longer)]
    if whole_step:
        grads = sum(totals)
    elif by_chunk and len(short) > 1:
        tail = {c: sum(n + (-n) % d for n in p.in_flight[overlap]) for c, p in plan.items()}
        after = [tail[short[c + 1]] if c + 1 < len(short) else 0 for c in range(len(short))]
        if rounds > 1:
            after[-1] = tail[short[0]]
        grads = max(t + a for t, a in zip(totals, after))
    elif overlap:  # each kind of chunk alone, and each after the chunk after it (its last backward)
        runs = {(c,) for c in short} | {(short[i + 1], short[i]) for i in range(len(short) - 1)}
        key = (model, tp, split, bucket, params_sharded, divisible_by, main_grad)
        grads = max(_padded_peak(_allocation_states(*key, run, experts), d) for run in runs)
    else:
        grads = max(t + (totals[c + 1] if c + 1 < len(totals) else 0) for c, t in enumerate(totals))
    if not params_sharded:
        return 0, grads
    if not reshard:  # every unit of the stage (each bucket belongs to one unit)
        return sum(totals), grads
    return max(_resharded_peak(_unit_sizes(plan[c], d)) for c in set(short)), grads


@dataclass(frozen=True)
class _Plan:
    """One chunk's parameters (:func:`chunk_params`), buckets (parameter indices), their unpadded
    elements, the events of its backward with overlap (keys: bucket indices), and chunk by chunk
    the unpadded elements of the two buckets still in flight after its reduction, without and
    with overlap (:func:`_in_flight`)."""

    params: tuple
    buckets: tuple
    raw: tuple
    events: tuple
    in_flight: tuple = ((), ())


@lru_cache(maxsize=1024)
def _chunk_plan(
    model: ModelConfig,
    tp: int,
    split: bool,
    chunk: Chunk,
    bucket: int,
    by_unit: bool,
    divisible_by: int,
    main_grad: bool = False,
    experts: bool = False,
) -> _Plan:
    """The :class:`_Plan` of ``chunk`` (``split``: pp > 1; ``main_grad``: 16-bit weights; ``experts``:
    an MoE layer's routed experts in this buffer)."""
    params = chunk_params(model, tp, chunk, divisible_by, experts)
    deferred = _tied_copy_index(model, split, chunk)
    word = int(model.has_position_table) if chunk.first else None
    order = _ready_order(model, tp, params, word, main_grad, experts)
    buckets = plan_buckets(params, bucket, by_unit=by_unit, deferred=deferred)
    raw = tuple(sum(params[i][0] for i in members) for members in buckets)
    plan = _Plan(params, buckets, raw, tuple(_backward_events(params, buckets, deferred, order)))
    in_flight = tuple(tuple(raw[b] for b in _in_flight(plan, overlap)) for overlap in (False, True))
    return _Plan(params, buckets, raw, plan.events, in_flight)


def _tied_copy_index(model: ModelConfig, split: bool, chunk: Chunk) -> int | None:
    """Index in :func:`chunk_params` of the tied word embedding whose bucket is kept alone and
    never started early (``split``, pp > 1: its gradient is summed over the first and last
    stage first; not where one rank holds both, :attr:`Chunk.shared_table`)."""
    if not model.tied or not split or not (chunk.first or chunk.last) or chunk.shared_table:
        return None
    return 1 if chunk.first and model.has_position_table else 0


def _unit_sizes(plan: _Plan, d: int) -> dict[int, int]:
    """Unit -> its padded elements (a bucket never spans two units)."""
    out: dict[int, int] = {}
    for members, n in zip(plan.buckets, plan.raw):
        unit = plan.params[members[0]][2]
        out[unit] = out.get(unit, 0) + n + (-n) % d
    return out


def _resharded_peak(units: dict[int, int]) -> int:
    """Most gathered elements at once with resharding: two neighbours in forward order (embeddings,
    layers, head), or the single tied unit with two layers."""
    layers = [units[k] for k in sorted(k for k in units if k >= 0)]
    if TIED_UNIT in units:
        pairs = [a + b for a, b in zip(layers, layers[1:])] or layers or [0]
        return units[TIED_UNIT] + max(pairs)
    seq = (
        ([units[EMBED_UNIT]] if EMBED_UNIT in units else [])
        + layers
        + ([units[HEAD_UNIT]] if HEAD_UNIT in units else [])
    )
    pairs = [a + b for a, b in zip(seq, seq[1:])] or seq or [0]
    return max(pairs)


def unit_gathers(
    model: ModelConfig,
    tp: int,
    pp: int,
    chunks: tuple[Chunk, ...],
    d: int,
    bucket: int,
    *,
    divisible_by: int = 128,
    experts: bool = False,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``optim_grads_params``: the parameter all-gathers of one microbatch on one rank holding ``chunks``,
    as (calls, padded elements) for its forwards and for its backwards (resharded after forward): one
    call per bucket of each unit gathered, this rank sending ``1/d`` of its elements. Backward skips the
    embeddings' unit (:data:`EMBED_UNIT`: the lookups' gradients need the ids, not the tables).
    """
    forward, backward = [0, 0], [0, 0]
    for chunk in chunks:
        plan = _chunk_plan(model, tp, pp > 1, chunk, bucket, True, divisible_by, experts=experts)
        for members, n in zip(plan.buckets, plan.raw):
            passes = (forward,) if plan.params[members[0]][2] == EMBED_UNIT else (forward, backward)
            for counts in passes:
                counts[0] += 1
                counts[1] += n + (-n) % d
    return (forward[0], forward[1]), (backward[0], backward[1])
