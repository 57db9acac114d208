"""``--data-parallel-sharding-strategy optim_grads`` (ZeRO-2) trains exactly like one process
without sharding (float64, 3 AdamW steps, clipping firing, 2-4 microbatches accumulated per step):
per-step losses and gradient norms within 1e-9 relative, every parameter after them, at (tp, pp,
dp) = (1,1,4), (2,1,2), (1,2,2), (2,2,2), with buckets reduced when each backward ends or during
it (with the parameter all-gather overlapped with the next forward), the tied embedding summed
over its two stages' shards, an untied output layer and the interleaved schedule at pp = 2, the
Llama-like model with full recompute and sequence parallelism at (2,1,2), and context parallelism
at (tp, cp, pp, dp) = (1,2,1,2) (shards over dp x cp); bf16 weights within
bf16 precision at (1,1,4) and (2,2,2) (:data:`helpers.zero_cases.RUNS`). Replicas and tied copies
stay bitwise equal. Each rank keeps 1/dp of the gradients between microbatches, as the planner
counts them, and every backward reduce-scatters what it produced, except with the interleaved
schedule in one round (m == pp) at (1,2,2), (2,2,2) and (1,2,4), both strategies, where each chunk's
buckets accumulate its microbatches and are reduce-scattered once per step (chunk by chunk, as
the planner models it). All layouts of a world size run in one job (:mod:`helpers.zero_cases`)."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helpers import run_in_pool
from helpers.torch_features import NEEDS_FUSED_WGRAD
from helpers.zero_cases import (
    CHUNK_VARIANTS,
    CP_LAYOUT,
    CP_VARIANT,
    FP16_STRATEGIES,
    LAYOUTS,
    ROUND_TRIPS,
    VARIANTS,
    check_against_reference,
    check_transients,
    checkpoint_worker,
    cp_config,
    fp16_worker,
    is_chunk_by_chunk,
    planner_gathers,
    strategy_of,
    variants,
    world_results,
    zero_config,
)
from ptdp.run.planner_report import compare

CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]
IDS = ["tp{}pp{}dp{}".format(*layout) for _, layout in CASES]


@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_trains_like_one_process(world, layout):
    results = [rank_results[layout] for rank_results in world_results(world)]
    for name in variants(*layout, "optim_grads"):
        check_against_reference(results, name)


def test_optim_grads_with_context_parallelism_trains_like_one_process():
    """(tp, cp, pp, dp) = (1,2,1,2): the shards are over the 4 dp x cp ranks, gradients summed over
    cp and averaged over dp; each rank keeps a quarter of them."""
    assert cp_config(CP_VARIANT).parallel.cp == 2
    results = [rank_results[CP_LAYOUT] for rank_results in world_results(4)]
    check_against_reference(results, CP_VARIANT)
    for res in results:
        m = res[CP_VARIANT]["measured"]
        assert m["grads"] == 8 * (m["numel"] + m["padding"]) // 4, m


@NEEDS_FUSED_WGRAD  # the planner counts the fused path
@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_keeps_a_shard_as_the_planner_counts(world, layout):
    """Bytes per rank: gradients and optimizer state 1/dp of the stage's (plus bucket padding),
    parameters whole; equal to the planner's for the run's strategy on every rank (bf16)."""
    results = [rank_results[layout] for rank_results in world_results(world)]
    dp = layout[2]
    if "grads_bf16" in variants(*layout):  # the planner models bf16, not float64
        measured = [res["grads_bf16"]["measured"] for res in results]
        check = compare(zero_config("grads_bf16", *layout), measured, None, None)
        assert check["bytes_exact_on_every_rank"], check["ranks"]
    for name in variants(*layout, "optim_grads"):
        grad_bytes, opt_bytes = (4, 12) if VARIANTS[name][0] == "bfloat16" else (8, 16)  # float64: no main params
        for res in results:
            m = res[name]["measured"]
            assert m["grads"] == grad_bytes * (m["numel"] + m["padding"]) // dp, (name, m)
            assert m["optimizer"] == opt_bytes * (m["numel"] + m["padding"]) // dp, (name, m)


@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_every_backward_reduce_scatters_its_gradients(world, layout):
    """Communication of step 0 on the dp axis: one reduce-scatter per bucket and per backward
    (m microbatches, v model chunks), each of the bucket's float64 bytes; no gradient all-reduce;
    one parameter all-gather per bucket."""
    results = [rank_results[layout] for rank_results in world_results(world)]
    dp = layout[2]
    names = [n for n in variants(*layout, "optim_grads") if n not in CHUNK_VARIANTS]
    if not names:  # (1,2,4) runs chunk by chunk only: test_chunk_by_chunk_reduces_each_bucket_once_per_step
        return
    name = names[0]  # float64, one model chunk
    cfg = zero_config(name, *layout)
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    for res in results:
        run = res[name]
        comm = run["comm"]
        rs = comm.get("dp/reduce_scatter/grads")
        assert rs is not None and "dp/all_reduce/grads" not in comm, comm
        assert rs["calls"] % m == 0 and rs["calls"] // m > 1, (rs, m)  # the same buckets in every backward
        assert rs["numel"] == m * run["grad_numel"], (rs, m, run["grad_numel"])
        assert comm["dp/all_gather/params"]["numel"] == run["grad_numel"] // dp, comm  # this rank's share


#: float64 variants reducing 1500-element buckets during backward
REDUCING_IN_BACKWARD = ("grads_overlap", "grads_sp")
OVERLAPPED = [(world, layout) for world, layout in CASES if set(REDUCING_IN_BACKWARD) & set(variants(*layout))]


@pytest.mark.parametrize("world, layout", OVERLAPPED, ids=["tp{}pp{}dp{}".format(*layout) for _, layout in OVERLAPPED])
def test_a_backward_holds_only_some_buckets(world, layout):
    """Bucket gradient memory exists only during a backward, a few buckets at a time: reduced
    during backward (1500-element buckets, at most two in flight), a rank never holds its whole
    gradient (``grad_numel``, padded) at once; the transient is at least one bucket."""
    for res in (rank_results[layout] for rank_results in world_results(world)):
        name = next(n for n in variants(*layout) if n in REDUCING_IN_BACKWARD)
        m = res[name]["measured"]
        full = 8 * (m["numel"] + m["padding"])
        assert 8 * 1500 <= m["grads_transient"] < full, (m["grads_transient"], full)


@NEEDS_FUSED_WGRAD  # the planner counts the fused path
@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_transient_is_what_the_planner_counts(world, layout):
    """The most full-size bucket gradient memory a rank held at once over the run (the engine's
    own counter) equals the planner's count exactly, on every rank: buckets of 901 and 1,500
    elements (smaller than a layer), of a layer's size at tp 1 and the default (the whole stage),
    reduced during backward (at most two in flight) and when each backward ends (all of a
    backward's buckets at its end; interleaved: also the buckets a chunk's last backward leaves
    to the next chunk's backward), tied and untied output layers, tp 1 and 2, pp 1 and 2, the
    interleaved schedule, bf16 main gradients; and at (tp, cp, pp, dp) = (1,2,1,2)."""
    results = [rank_results[layout] for rank_results in world_results(world)]
    for name in variants(*layout, "optim_grads"):
        check_transients(results, name, zero_config(name, *layout))
    if world == 4:
        check_transients([r[CP_LAYOUT] for r in world_results(4)], CP_VARIANT, cp_config(CP_VARIANT))


CHUNKED = [(world, layout) for world, layout in CASES if set(CHUNK_VARIANTS) & set(variants(*layout))]
CHUNKED_IDS = ["tp{}pp{}dp{}".format(*layout) for _, layout in CHUNKED]


def _chunked(layout: tuple) -> list[str]:
    """The chunk-by-chunk variants of ``layout`` (interleaved, m == pp: checked)."""
    names = [name for name in variants(*layout) if name in CHUNK_VARIANTS]
    for name in names:
        assert is_chunk_by_chunk(zero_config(name, *layout)), name
    return names


@pytest.mark.parametrize("world, layout", CHUNKED, ids=CHUNKED_IDS)
def test_chunk_by_chunk_reduces_each_bucket_once_per_step(world, layout):
    """Interleaved in one round (v = 2 chunks, m == pp = 2 microbatches, dp 2), both strategies:
    step 0 reduce-scatters every bucket once (not once per microbatch), the stage's N padded
    gradient elements in all, the planner's count for chunk by chunk (``m * N`` otherwise);
    optim_grads_params still gathers every unit's buckets in every forward and, but the
    embeddings', backward (the planner's counts: 2 m N / dp elements sent on the last stage),
    optim_grads the updated shard once. The step makes no call that would synchronise the host
    on a GPU."""
    results = [rank_results[layout] for rank_results in world_results(world)]
    dp = layout[2]
    for name in _chunked(layout):
        cfg = zero_config(name, *layout)
        m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
        assert m == layout[1] == 2, (name, m)
        for res in results:
            run = res[name]
            comm, buckets = run["comm"], run["buckets"]
            assert sum(n for _, n in buckets) == run["grad_numel"] and {c for c, _ in buckets} == {0, 1}
            rs, gathers = comm["dp/reduce_scatter/grads"], comm["dp/all_gather/params"]
            assert "dp/all_reduce/grads" not in comm, comm
            assert (rs["calls"], rs["numel"]) == (len(buckets), run["grad_numel"]), (name, rs, len(buckets))
            want = (len(buckets), run["grad_numel"] // dp)  # the updated shard, once
            if strategy_of(name) == "optim_grads_params":
                forward, backward = planner_gathers(cfg, run["coords"][2])
                assert forward == (len(buckets), run["grad_numel"]), (name, forward)
                want = (m * (forward[0] + backward[0]), m * (forward[1] + backward[1]) // dp)
            assert (gathers["calls"], gathers["numel"]) == want, (name, gathers, want)
            assert run["syncs"] == [], (name, run["syncs"])  # no call that would wait for a GPU


#: the interleaved variants at (1, 2, 2): m = 4 microbatches on pp = 2 ranks, two rounds
ROUNDS_VARIANTS = ("grads_interleaved", "params_interleaved", "grads_interleaved_sync")


def test_chunk_by_chunk_reduces_each_bucket_once_per_round():
    """Interleaved in two rounds (v = 2 chunks, m = 4 = 2 pp microbatches, dp 2), both strategies,
    reduced during the backwards and after them: step 0 reduce-scatters every bucket once per
    round, 2 N elements for a stage of N padded gradient elements (the planner's count, ``m / pp``
    reductions per chunk; ``m N`` when every microbatch reduces), with no call that would
    synchronise the host on a GPU. The exactness against one process and the transient equal to
    the planner's are the other tests' (these variants are among theirs)."""
    layout = (1, 2, 2)
    for res in (rank_results[layout] for rank_results in world_results(4)):
        for name in ROUNDS_VARIANTS:
            assert name in variants(*layout), name
            cfg = zero_config(name, *layout)
            m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout[2])
            assert is_chunk_by_chunk(cfg) and m == 2 * layout[1] == 4, (name, m)
            run = res[name]
            buckets, rs = run["buckets"], run["comm"]["dp/reduce_scatter/grads"]
            assert {c for c, _ in buckets} == {0, 1} and sum(n for _, n in buckets) == run["grad_numel"]
            assert (rs["calls"], rs["numel"]) == (2 * len(buckets), 2 * run["grad_numel"]), (name, rs)
            assert run["syncs"] == [], (name, run["syncs"])


def _peaks(buckets: list[tuple[int, int]]) -> tuple[int, int, int]:
    """Elements of the chunk-by-chunk bucket peaks of a stage of ``buckets`` ((chunk, elements) in
    bucket order): (the largest chunk, the exact peak when each chunk's buckets are started in
    bucket order after its last backward (no overlap: the chunk reduced first alone, every other
    one with the last two buckets of the chunk after it in flight), the most it can be with two
    buckets of the chunk after it in flight)."""
    chunks = max(c for c, _ in buckets) + 1
    sizes = [[n for c, n in buckets if c == chunk] for chunk in range(chunks)]
    totals = [sum(s) for s in sizes]
    in_order = max([totals[-1]] + [totals[c] + sum(sizes[c + 1][-2:]) for c in range(chunks - 1)])
    bound = max([totals[-1]] + [totals[c] + sum(sorted(sizes[c + 1])[-2:]) for c in range(chunks - 1)])
    return max(totals), in_order, bound


@pytest.mark.parametrize("world, layout", CHUNKED, ids=CHUNKED_IDS)
def test_chunk_by_chunk_holds_one_chunks_gradient(world, layout):
    """The most full-size bucket gradient memory a rank held at once (``GradBuffer.peak_live_bytes``)
    is one model chunk's whole gradient (its buckets accumulate the chunk's microbatches) plus at
    most two buckets of the chunk reduced before it, still in flight: exactly so, without overlap,
    for the last two buckets of that chunk; less than the stage's gradient. Float64 (8 bytes) or
    bf16's float32 main gradients (4). The planner's chunk-by-chunk transient equals it on every
    rank (the transient tests of both strategies run these variants too)."""
    for res in (rank_results[layout] for rank_results in world_results(world)):
        for name in _chunked(layout):
            cfg = zero_config(name, *layout)
            size = 4 if VARIANTS[name][0] == "bfloat16" else 8
            largest, in_order, bound = _peaks(res[name]["buckets"])
            peak = res[name]["measured"]["grads_transient"]
            assert size * largest <= peak <= size * bound < size * res[name]["grad_numel"], (name, peak)
            if not cfg.parallel.overlap_grad_reduce:
                assert peak == size * in_order, (name, res[name]["coords"], peak, in_order)


def test_checkpoints_cross_strategies_and_dp_sizes(tmp_path):
    """Saved with optim_grads (and, in the same job, optim_grads_params) at (1,1,4), loaded with
    no_shard at (2,1,2), saved there and loaded with the first strategy at (1,1,4) with other
    buckets: parameters and Adam moments bitwise equal at every stop; the third step after the
    round trip equals the one trained without stopping."""
    results = run_in_pool(checkpoint_worker, 4, str(tmp_path))
    for name, trip in ROUND_TRIPS.items():
        for res in (rank_results[name] for rank_results in results):
            saved = res["states"][0]
            assert any(key.startswith("exp_avg_sq/") for key in saved)
            for state, case in zip(res["states"][1:], trip[1:]):
                assert sorted(state) == sorted(saved), case
                for key, value in saved.items():
                    assert torch.equal(state[key], value), (name, case, key)
            assert res["resumed"] == res["whole"], name


def test_fp16_overflow_in_one_shard_skips_the_step_everywhere():
    """float16 with optim_grads and with optim_grads_params: an inf in one rank's gradient shard
    skips the step on every rank as float16's overflow (parameters unchanged, scale halved
    everywhere); the next step trains at the halved scale and makes no call that would
    synchronise the host on a GPU."""
    from ptdp.engine.step import FP16_OVERFLOW

    for rank_results in run_in_pool(fp16_worker, 4):
        assert sorted(rank_results) == sorted(FP16_STRATEGIES)
        for strategy, res in rank_results.items():
            assert res["skipped"] and res["reason"] == FP16_OVERFLOW and res["unchanged"], (strategy, res)
            assert res["scales"] == (2.0**16, 2.0**15) and res["used"] == 2.0**16, (strategy, res)
            assert not res["good_skipped"] and res["good_used"] == 2.0**15, (strategy, res)
            assert res["changed_after_good"], (strategy, res)
            assert res["syncs"] == [] and res["loss"] > 0, (strategy, res)
