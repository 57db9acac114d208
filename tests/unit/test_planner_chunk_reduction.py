"""Sharded gradients reduced chunk by chunk (``ptdp.layout.buckets.chunk_by_chunk``): with the
interleaved schedule (v > 1, m a multiple of pp) every backward of a round's pp microbatches of a
model chunk runs before the chunk before it, so optim_grads / optim_grads_params accumulate one
chunk's float32 gradient of the round whole and reduce-scatter it once per round, behind the next
chunk's backwards (the Llama 3 405B run, Dubey et al. 2024, §3.3.2)."""

from __future__ import annotations

import pytest

from ptdp.layout.buckets import chunk_by_chunk, chunk_rounds
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import Cluster, get_gpu
from ptdp.planner.inputs.models import get_model
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.chunk_params import stage_chunks
from ptdp.planner.memory.params import layer_param_count, stage_param_counts
from ptdp.planner.memory.strategies import DEFAULT_BUCKET_ELEMENTS, stage_state_bytes
from ptdp.planner.memory.transients import rank_transients
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.time.collectives import Links, hierarchical_all_reduce_time
from ptdp.planner.time.data_parallel import sharded_dp_times
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.planner.validate.published import H100_CSV, load_h100_runs

H100 = get_gpu("h100-sxm")
LINKS = Links(
    nvlink_bandwidth=400e9, network_bandwidth=40e9, nvlink_latency=5e-6, network_latency=10e-6, gpus_per_node=8
)


@pytest.mark.parametrize(
    "strategy, shard, v, m, pp, expected",
    [
        ("optim_grads", 128, 8, 16, 16, True),
        ("optim_grads_params", 4, 2, 4, 4, True),
        ("optim_grads", 128, 8, 32, 16, True),  # two rounds: once per round
        ("optim_grads", 128, 1, 16, 16, False),  # one chunk: every microbatch touches the whole stage
        ("optim", 128, 8, 16, 16, False),
        ("no_shard", 128, 8, 16, 16, False),
        ("optim_grads", 1, 8, 16, 16, False),  # nothing to shard
    ],
)
def test_when_gradients_are_reduced_chunk_by_chunk(strategy, shard, v, m, pp, expected):
    assert chunk_by_chunk(strategy, shard, v, m, pp) is expected


def test_rounds_of_the_interleaved_schedule():
    assert [chunk_rounds(m, 4) for m in (4, 8, 12)] == [1, 2, 3]


def test_transients_add_their_elements_to_the_shares():
    """stage_state_bytes adds the transients it is given (elements, from
    ptdp.planner.memory.transients) to the strategy's shares: float32 gradient elements for both
    sharded-gradient strategies, 16-bit parameter elements for optim_grads_params only (whose
    shard is float32, the main copy)."""
    n, grads_transient, params_transient = 8_000_000, 1_000_000, 400_000
    kw = dict(params_transient=params_transient, grads_transient=grads_transient)
    params, grads, _ = stage_state_bytes(n, "bf16", "optim_grads", 16, **kw)
    assert (params, grads) == (2 * n, 4 * n / 16 + 4 * grads_transient)
    params, grads, _ = stage_state_bytes(n, "bf16", "optim_grads_params", 16, **kw)
    assert (params, grads) == (4 * n / 16 + 2 * params_transient, 4 * n / 16 + 4 * grads_transient)
    assert stage_state_bytes(n, "bf16", "optim", 16, **kw) == stage_state_bytes(n, "bf16", "optim", 16)


def test_chunk_reduce_scatters_hide_behind_the_next_round():
    g, p, u = 4e9, 2e9, 1e8
    kw = dict(
        grad_bytes=g,
        param_bytes=p,
        unit_param_bytes=u,
        tp=8,
        shard=64,
        units=10,
        layer_forward=0.001,
        layer_backward=0.002,
        links=LINKS,
        num_microbatches=16,
    )
    ar = lambda nbytes: hierarchical_all_reduce_time(nbytes, 64, 1, LINKS)  # noqa: E731 - tp 8 fills the node
    chunk_rs, ag = ar(g / 8) / 2, ar(p) / 2
    hidden = sharded_dp_times("optim_grads", microbatch_backward=10.0, chunks=8, **kw)
    assert hidden == pytest.approx(chunk_rs + ag)  # only the last chunk's, then the weights' all-gather
    exposed = sharded_dp_times("optim_grads", microbatch_backward=0.0, chunks=8, **kw)
    assert exposed == pytest.approx(8 * chunk_rs + ag)  # nothing to hide behind: every chunk's
    assert sharded_dp_times("optim_grads", microbatch_backward=0.0, chunks=1, **kw) == pytest.approx(
        16 * ar(g) / 2 + ag
    )
    # two rounds of 8 microbatches: every chunk reduced twice, hidden behind 8 backwards of the next
    assert sharded_dp_times("optim_grads", microbatch_backward=0.0, chunks=8, rounds=2, **kw) == pytest.approx(
        16 * chunk_rs + ag
    )
    assert sharded_dp_times("optim_grads", microbatch_backward=10.0, chunks=8, rounds=2, **kw) == pytest.approx(
        chunk_rs + ag
    )
    per_chunk_round = 8 * 0.5 * chunk_rs / 8  # half of one chunk's reduce-scatter hidden per backward round
    half = sharded_dp_times("optim_grads", microbatch_backward=per_chunk_round, chunks=8, rounds=2, **kw)
    assert half == pytest.approx(15 * 0.5 * chunk_rs + chunk_rs + ag)
    with_params = sharded_dp_times("optim_grads_params", microbatch_backward=10.0, chunks=8, **kw)
    per_microbatch = 2 * ar(u) / 2 + 9 * max(0, ar(u) / 2 - 0.001) + 9 * max(0, ar(u) / 2 - 0.002)
    assert with_params == pytest.approx(16 * per_microbatch + chunk_rs)


def test_memory_and_time_of_a_one_round_interleaved_layout():
    model = get_model("llama3-405b")
    split = (7,) + (8,) * 14 + (7,)
    base = Candidate.of(
        8, 16, 128, 1, 2048, virtual_stages=8, sequence_parallel=True, layer_split=split, sharding="optim_grads"
    )
    mem = memory_breakdown(model, base, H100)
    n = stage_param_counts(model, 8, 16, layer_split=split)[mem.stage]
    layers = split[mem.stage]
    # the memory is what ptdp holds: a chunk's buckets whole (reduced once per round, chunk by
    # chunk) beside two of the chunk after it in flight; in two rounds also the last chunk's beside
    # two of the first's
    chunks = stage_chunks(model.num_layers, 16, 8, mem.stage, layers)
    kw = dict(overlap=True, params_sharded=False)
    _, by_chunk = rank_transients(model, 8, 16, chunks, 128, DEFAULT_BUCKET_ELEMENTS, **kw, by_chunk=True)
    assert by_chunk >= layer_param_count(model, 8)  # at least one chunk (a layer) whole
    assert mem.grads == pytest.approx(4 * n / 128 + 4 * by_chunk)
    two_rounds = base.replace(global_batch_size=4096)  # m = 32
    _, rounds = rank_transients(model, 8, 16, chunks, 128, DEFAULT_BUCKET_ELEMENTS, **kw, by_chunk=True, rounds=2)
    assert rounds >= by_chunk
    assert memory_breakdown(model, two_rounds, H100).grads == pytest.approx(4 * n / 128 + 4 * rounds)
    cluster = Cluster(H100, 16384, 8)
    by_chunk = evaluate_performance(model, base, cluster).time.dp_comm
    optim = evaluate_performance(model, base.replace(sharding=None, distributed_optimizer=True), cluster).time.dp_comm
    assert by_chunk < optim  # one chunk's reduce-scatter exposed instead of the whole stage's


def test_llama3_405b_published_layout_is_planned_within_10_percent():
    """Meta's 8K stage: 16,384 H100, tp 8, pp 16, dp 128 (Llama 3 paper, Table 4: 400 TFLOP/s per
    GPU, a 6.753 s step) is listed among the fitting layouts, predicted within 10%."""
    reported = next(
        r
        for r in load_h100_runs(H100_CSV)
        if r.name == "Llama 3 405B" and r.layout.num_gpus == 16384 and r.layout.cp == 1
    ).step_time
    assert reported == pytest.approx(6.753, abs=1e-3)
    result = search(get_model("llama3-405b"), Cluster(H100, 16384, 8), 2048)
    meta = [p for p in result.plans if (p.layout.tp, p.layout.pp, p.layout.dp, p.layout.cp) == (8, 16, 128, 1)]
    assert meta, "Meta's layout must fit"
    best = min(meta, key=lambda p: p.time.step)
    assert abs(best.time.step / reported - 1) <= 0.10, (best.layout, best.time.step, reported)
    assert best.layout.sharding_strategy == "optim_grads" and best.layout.virtual_stages == 8
    assert result.plans.index(best) < 5


def test_search_evaluates_chunk_by_chunk_optim_grads_beside_optim():
    model = get_model("llama3-8b")
    cluster = Cluster(H100, 64, 8)
    result = search(
        model,
        cluster,
        32,
        fixed=Fixed(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=4,
            micro_batch_size=1,
            virtual_pipeline_model_parallel_size=2,
            recompute_granularity="none",
            sequence_parallel=True,
        ),
    )
    strategies = {p.layout.sharding_strategy for p in result.plans if p.layout.num_microbatches == 4}
    assert {"optim", "optim_grads"} <= strategies
