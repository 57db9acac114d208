"""The planner's zero-bubble schedules (zb-h1, zb-h2, zb-v, dualpipev): their bubble from the timed
simulation of their own programs against the papers' closed forms, the step time with B and W
apart, the activations each holds from its own order (W's tensors included), the search that
plans them with runnable flags, and ``ptdp train``'s report of the run's bubble."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex

import pytest

import ptdp
from ptdp.cli import main
from ptdp.config import fields
from ptdp.config.flags import add_flags, config_from_args
from ptdp.config.resolve import resolve
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS, build_schedule
from ptdp.layout.pipeline.timing import StageTimes, dependencies
from ptdp.planner.candidate import Candidate, run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import layer_activation_bytes, stage_activation_bytes, wgrad_kept_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.in_flight import held_points, peak_held
from ptdp.planner.memory.params import stage_param_counts
from ptdp.planner.report.explain import layout_flags
from ptdp.planner.search import layouts
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.search.rules import trains_schedule, untrained_schedule_rejections
from ptdp.planner.time import flops
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants
from ptdp.planner.time.pipeline_bubble import bubble_floor, ideal_bubble, schedule_dependencies, step_bubble
from ptdp.planner.time.profile import save_profile
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.run.planner_report import compare, format_comparison

A100 = CATALOG["a100-80gb"]
#: schedules at v = 1 in the order of the activations they keep
HOLDS_ORDER = ("1f1b", "zb-h1", "zb-h2")
#: 16 layers of h = 2048: small enough to search in a second, pp = 4 fits any schedule
MODEL = gpt(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
UNIT = StageTimes(forward=1.0, backward_input=1.0, backward_weight=1.0)


def _idle(kind: str, p: int, m: int, times: StageTimes, *, synchronous: bool) -> float:
    v = 2 if placement_of(kind) == "v" else 1
    if kind == "1f1b":
        graph = dependencies(build_schedule(kind, p, m), virtual_stages=1)
        return graph.idle(times, 1, synchronous=synchronous)
    return step_bubble(kind, p, m, v, times, synchronous=synchronous)


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("extra", [0, 3, 5])
def test_simulated_bubbles_meet_the_closed_forms_under_equal_times(p, extra):
    """F = B = W = t for a rank's layers (t / 2 a chunk of the V), free transfers, m = 2p + extra
    (from 5p the timing is extended from shorter runs): the longest rank's idle time is Qi et al.'s
    bubble, 1F1B 3 (p - 1) t, ZB-H1 (p - 1) t, ZB-H2 and ZB-V 0, DualPipeV (p - 1)(F&B + B - 3W) in
    chunk times with its pairs one pass after the other (F&B = F + B + W): (p - 1) t / 2. The step,
    every rank waiting for the last, adds the last rank's late start where the papers have none:
    ZB-H2 (p - 1) F, ZB-V (p - 1) F / 2."""
    m, chunk = 2 * p + extra, 0.5
    per_rank = {
        "1f1b": 3 * (p - 1),
        "zb-h1": p - 1,
        "zb-h2": 0.0,
        "zb-v": 0.0,
        "dualpipev": (p - 1) * ((3 * chunk) + chunk - 3 * chunk),
    }
    step = {**per_rank, "zb-h2": p - 1, "zb-v": (p - 1) * chunk}
    for kind in per_rank:
        assert _idle(kind, p, m, UNIT, synchronous=False) == pytest.approx(per_rank[kind], abs=1e-9), kind
        assert _idle(kind, p, m, UNIT, synchronous=True) == pytest.approx(step[kind], abs=1e-9), kind
        assert ideal_bubble(kind, p, m, 2 if placement_of(kind) == "v" else 1) == pytest.approx(step[kind] / (3 * m))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.3, 0.7), (1.2, 1.0, 0.5), (0.8, 1.5, 0.8)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w(p, f, b, w):
    """ZB-H1 with W no longer than F or B: (p - 1)(F + B - W) (Qi et al. §2.1), 1F1B's (p - 1)(F + B + W)."""
    times = StageTimes(forward=f, backward_input=b, backward_weight=w)
    for m in (p, 3 * p, 6 * p + 1):
        assert _idle("zb-h1", p, m, times, synchronous=True) == pytest.approx((p - 1) * (f + b - w))
        assert _idle("1f1b", p, m, times, synchronous=True) == pytest.approx((p - 1) * (f + b + w))


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2", "zb-v", "dualpipev"])
def test_extended_timing_equals_the_whole_run(kind):
    """From 5p microbatches the step's idle time is extended from runs of under 5p: it equals the
    whole run's, under uneven times and slow links."""
    rng = random.Random(3)
    v = 2 if placement_of(kind) == "v" else 1
    for p in (2, 3, 5, 8):
        for _ in range(4):
            times = StageTimes(*(rng.uniform(0.2, 2.0) for _ in range(3)), p2p=rng.choice([0.0, rng.uniform(0, 1)]))
            m = rng.randint(5 * p, 12 * p)
            whole = schedule_dependencies(kind, p, m, v).idle(times, v)
            assert step_bubble(kind, p, m, v, times) == pytest.approx(whole, rel=1e-9, abs=1e-9)


def _layout(schedule: str, *, recompute: str = "none", pp: int = 4, v: int = 1, **kw) -> Candidate:
    return Candidate.of(1, pp, 2, 1, 32, v, recompute, False, schedule=schedule, sharding="optim", **kw)


def test_zb_h1_predicts_a_shorter_step_than_1f1b_with_the_same_everything_else():
    """pp = 4, m = 16: the same compute, communication and memory state; ZB-H1's bubble is the
    simulation of its program with the stage's F, B and W, shorter than 1F1B's (p - 1) slots."""
    cluster = Cluster(A100, 8)
    one = evaluate_performance(MODEL, _layout("1f1b"), cluster).time
    zb = evaluate_performance(MODEL, _layout("zb-h1"), cluster).time
    assert zb.step < one.step and zb.bubble < one.bubble
    assert (zb.compute, zb.recompute, zb.tp_comm, zb.pp_comm) == (one.compute, one.recompute, one.tp_comm, one.pp_comm)
    h2 = evaluate_performance(MODEL, _layout("zb-h2"), cluster).time
    assert h2.bubble < zb.bubble  # B is longer than W here: (p - 1) F < (p - 1)(F + B - W)


def test_w_efficiency_is_a_constant_per_gpu_generation():
    """A W GEMM at half the speed adds its weight-gradient time once more per layer and microbatch
    on the busiest stage (flops.layer_wgrad_time); the constant is looked up by the GPU's generation
    (a profile's lists too)."""
    cluster = Cluster(A100, 8)
    slow = dataclasses.replace(DEFAULT_CONSTANTS, wgrad_arch_efficiency=(("ampere", 0.5),))
    assert slow.for_gpu(A100).wgrad_efficiency == 0.5
    assert slow.for_gpu(CATALOG["h100-sxm"]).wgrad_efficiency == 1.0
    assert PerfConstants(wgrad_arch_efficiency=[["hopper", 0.8]]).for_gpu(CATALOG["h100-sxm"]).wgrad_efficiency == 0.8
    base = evaluate_performance(MODEL, _layout("zb-h1"), cluster).time
    halved = evaluate_performance(MODEL, _layout("zb-h1"), cluster, slow).time
    c = DEFAULT_CONSTANTS.for_gpu(A100)
    wgrad = flops.layer_wgrad_time(
        MODEL, 1, 1, A100.sustained_peak("bf16"), A100.memory_bandwidth * c.hbm_efficiency, c.gemm_peak_fraction, 64.0
    )
    assert halved.compute - base.compute == pytest.approx(16 * 4 * wgrad)  # m = 16, 4 layers a stage
    assert halved.step > base.step and halved.bubble < base.bubble  # ZB-H1's (p - 1)(F + B - W): W fills more
    one = evaluate_performance(MODEL, _layout("1f1b"), cluster, slow).time
    assert one == evaluate_performance(MODEL, _layout("1f1b"), cluster).time  # no W of its own


@pytest.mark.parametrize("p", [2, 4, 8])
def test_in_flight_peaks_come_from_each_schedules_own_order(p):
    """Rank 0 holds, from a forward to its B: ZB-H1 p microbatches (1F1B's), ZB-H2 2p - 1, ZB-V 2p
    chunks of half the layers (p microbatches), DualPipeV 2p + 1 chunks."""
    m = 4 * p
    for kind, v, chunks in (("zb-h1", 1, p), ("zb-h2", 1, 2 * p - 1), ("zb-v", 2, 2 * p), ("dualpipev", 2, 2 * p + 1)):
        assert peak_held(held_points(kind, p, m, v, 0), [1.0] * v, [0.0] * v) == chunks, kind
    # ZB-H1's rank r runs W r microbatches late: it holds what p - r forwards and r Ws keep
    points = held_points("zb-h1", p, m, 1, p - 1)
    assert peak_held(points, [0.0], [1.0]) == p  # after a B, before its W runs
    assert peak_held(points, [1.0], [0.0]) == 1


def test_w_keeps_the_linears_inputs_and_output_gradients():
    """Per layer and microbatch, T = b s tokens, t = 1: QKV keeps h and 3h, the projection h and h,
    fc1 h and 4h, fc2 4h and h (input and output gradient), 2 bytes each; a tp rank its share of
    the split ones, the replicated ones whole (sequence parallelism gathers them again for W)."""
    tokens, h = 2048, 2048
    assert wgrad_kept_bytes(MODEL, 1, 1) == 2 * tokens * (4 * h + 3 * h + 4 * h + 4 * h + h)
    assert wgrad_kept_bytes(MODEL, 4, 1) == 2 * tokens * (4 * h + (3 * h + h + 4 * h + 4 * h) / 4)
    assert wgrad_kept_bytes(MODEL, 1, 1, precision="fp8", fp8_recipe="tensorwise") == tokens * 16 * h


def test_activations_zb_h2_above_zb_h1_equal_to_1f1b():
    """No recompute, no sequence parallelism: W keeps less than a microbatch's activations, so
    ZB-H1's rank 0 holds 1F1B's p microbatches and its other ranks less; ZB-H2's rank 0 2p - 1
    and one W's tensors."""
    gpu = A100
    one, h1, h2 = (memory_breakdown(MODEL, _layout(kind), gpu) for kind in ("1f1b", "zb-h1", "zb-h2"))
    assert h1.activations == pytest.approx(one.activations) and h1.total == pytest.approx(one.total)
    assert h2.activations > h1.activations and h2.stage == 0
    per_layer = layer_activation_bytes(MODEL, 1, 1, sequence_parallel=False, recompute="none")
    assert wgrad_kept_bytes(MODEL, 1, 1) < per_layer
    extra = stage_activation_bytes(MODEL, _layout("zb-h2"), 0, 4) - stage_activation_bytes(
        MODEL, _layout("zb-h1"), 0, 4
    )
    mask = 2048 * 2048  # the embedding's dropout mask, 1 byte per value, with each microbatch's activations
    # ZB-H2's rank 0 runs its next forward before the W of its oldest B: 7 microbatches and one W's tensors
    assert extra == pytest.approx((2 * 4 - 1 - 4) * (4 * per_layer + mask) + 4 * wgrad_kept_bytes(MODEL, 1, 1))


def test_full_recompute_zb_holds_ws_tensors_that_1f1b_does_not():
    """With full recompute a microbatch keeps only each layer's input until B, but W keeps what its
    linears need (recomputed in B): ZB-H1's last rank, r = p - 1 Ws late, holds p of them after a B."""
    layers, p = 4, 4
    one = stage_activation_bytes(MODEL, _layout("1f1b", recompute="full"), p - 1, layers)
    zb = stage_activation_bytes(MODEL, _layout("zb-h1", recompute="full"), p - 1, layers)
    assert zb - one >= (p - 1) * layers * wgrad_kept_bytes(MODEL, 1, 1)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_zb_h2_needs_no_less_memory_than_zb_h1_nor_zb_h1_than_1f1b(recompute, sharding):
    """What lets the search pass over a zero-bubble layout whose schedule of no more activations
    does not fit (:data:`~ptdp.planner.search.layouts.HOLDS_NO_MORE`): at the same layout, split
    and strategy the totals never decrease along 1f1b, zb-h1, zb-h2, dense or MoE."""
    moe = get_model("qwen3-30b-a3b")
    checked = 0
    for model, ep in ((MODEL, 1), (moe, 1), (moe, 2)):
        for tp, pp, dp, b, split in (
            (1, 4, 2, 1, None),
            (2, 4, 1, 2, None),
            (1, 2, 4, 1, None),
            (1, 3, 2, 1, (4, 6, 6)),
        ):
            if model is moe:
                split = None if split is None else (14, 17, 17)
            for big_b in (8, 64):
                totals = []
                for kind in HOLDS_ORDER:
                    layout = Candidate.of(
                        tp,
                        pp,
                        dp,
                        b,
                        big_b,
                        1,
                        recompute,
                        tp > 1,
                        sharding=sharding,
                        schedule=kind,
                        layer_split=split,
                        ep=ep,
                    )
                    totals.append(memory_breakdown(model, layout, A100).total)
                assert totals == sorted(totals), (model.num_layers, tp, pp, dp, b, big_b, ep)
                checked += 1
    assert checked == 24


def test_search_passes_over_only_zero_bubble_layouts_that_cannot_fit():
    """The search with the pass-over finds the same fitting plans, with the same times, as the
    search predicting every zero-bubble layout, on a cluster where memory rejects many."""
    tight = dataclasses.replace(A100, memory_bytes=8 * 2**30)
    fixed = Fixed(pipeline_model_parallel_size=4)
    kept = search(MODEL, Cluster(tight, 32), 64, fixed=fixed)
    saved = dict(layouts.HOLDS_NO_MORE)
    try:
        layouts.HOLDS_NO_MORE.clear()
        every = search(MODEL, Cluster(tight, 32), 64, fixed=fixed)
    finally:
        layouts.HOLDS_NO_MORE.update(saved)
    assert [(p.layout, p.time) for p in kept.plans] == [(p.layout, p.time) for p in every.plans]
    zero_bubble = [p for p, _ in every.rejected if p.layout.parallel.schedule in ("zb-h1", "zb-h2")]
    assert len(kept.rejected) < len(every.rejected) and zero_bubble
    assert {p.layout.parallel.schedule for p in kept.plans} >= {"1f1b", "zb-h1"}


@pytest.mark.parametrize("kind", sorted(SPLIT_ORDERS))
def test_the_bubble_floor_is_below_every_simulated_bubble(kind):
    """The search ranks a zero-bubble plan by its step with :func:`bubble_floor` for its bubble:
    never above the simulated one, under random times, transfers and sizes (m >= 2 pp on the
    DualPipeV schedule); equal when nothing but the last rank's late start idles."""
    rng = random.Random(7)
    v = 2 if placement_of(kind) == "v" else 1
    for _ in range(12):
        p = rng.choice([2, 3, 4, 6, 8])
        m = rng.randint(2 * p if kind == "dualpipev" else 1, 6 * p)
        times = StageTimes(rng.uniform(0.1, 2), rng.uniform(0.1, 2), rng.uniform(0.05, 1.5), rng.choice([0, 0.01, 0.4]))
        assert bubble_floor(p, v, times) <= step_bubble(kind, p, m, v, times) + 1e-12, (p, m, times)
    assert (
        bubble_floor(4, 1, StageTimes(1.0, 0.0, 0.0, 0.0))
        == step_bubble("zb-h1", 4, 8, 1, StageTimes(1.0, 0.0, 0.0, 0.0))
        == 3.0
    )


def test_v_placement_puts_the_last_stage_on_rank_0():
    """zb-v and dualpipev: rank 0 runs chunk 0 (the first stage) and chunk 1 (the last stage),
    whose tied output weight is chunk 0's embedding (one parameter, counted once)."""
    looped = stage_param_counts(MODEL, 1, 4)
    v = stage_param_counts(MODEL, 1, 4, placement="v")
    embedding = 51200 * 2048  # V = 51,200 is a multiple of 128: no padding
    assert v[0] == looped[0] + looped[-1] - looped[1] - embedding and v[1:] == [looped[1]] * 3
    zbv = memory_breakdown(MODEL, _layout("zb-v", v=2), A100)
    assert zbv.stage == 0


def _flags_config(plan_flags: str, model_flags: list[str], big_b: int):
    parser = argparse.ArgumentParser()
    add_flags(parser, "train")
    args = parser.parse_args([*plan_flags.split(), *model_flags, "--global-batch-size", str(big_b)])
    return config_from_args(args)


MODEL_FLAGS = [
    "--num-layers",
    "16",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "2048",
    "--vocab-size",
    "51200",
]


def test_search_picks_a_zero_bubble_plan_whose_flags_ptdp_train_resolves():
    """pp fixed at 4 on 8 GPUs: the best plan runs a zero-bubble schedule ptdp train runs, printed
    as --pipeline-schedule; every plan's flags resolve."""
    result = search(MODEL, Cluster(A100, 8), 32, fixed=Fixed(pipeline_model_parallel_size=4))
    best = result.plans[0].layout
    trained = set(fields.SCHEDULES) - set(fields.SCHEDULES_NOT_TRAINED)
    assert best.parallel.schedule in set(SPLIT_ORDERS) & trained
    assert f"--pipeline-schedule {best.parallel.schedule}" in layout_flags(best)
    kinds = {p.layout.parallel.schedule for p in result.plans}
    assert {"1f1b", "zb-h1", "zb-h2"} <= kinds and kinds <= trained
    for plan in result.plans[:20]:
        lay = plan.layout
        resolved = resolve(_flags_config(layout_flags(lay), MODEL_FLAGS, 32), 8)
        assert resolved.parallel.schedule == lay.parallel.schedule
        assert resolved.pipeline.virtual_stages == lay.virtual_stages


def test_search_plans_the_v_schedules():
    """zb-v and dualpipev are planned at v = 2 on the V placement, flags that resolve included."""
    result = search(MODEL, Cluster(A100, 8), 32, fixed=Fixed(pipeline_model_parallel_size=4))
    v_plans = [p for p in result.plans if p.layout.parallel.schedule in ("zb-v", "dualpipev")]
    assert {p.layout.parallel.schedule for p in v_plans} == {"zb-v", "dualpipev"}
    for plan in v_plans[:6]:
        lay = plan.layout
        assert lay.virtual_stages == 2 and lay.num_microbatches >= (
            2 * lay.pp if "dual" in lay.parallel.schedule else 1
        )
        resolved = resolve(_flags_config(layout_flags(lay), MODEL_FLAGS, 32), 8)
        assert resolved.parallel.schedule == lay.parallel.schedule and resolved.pipeline.virtual_stages == 2


def test_a_fixed_schedule_is_planned_alone_and_one_ptdp_train_refuses_is_a_bad_request(capsys):
    """--pipeline-schedule fixes the schedule; one ptdp train does not run yet or the planner does
    not model (auto) is refused before any search (exit 2)."""
    result = search(MODEL, Cluster(A100, 8), 32, fixed=Fixed(pipeline_model_parallel_size=4, pipeline_schedule="zb-h2"))
    assert {p.layout.parallel.schedule for p in result.plans} == {"zb-h2"}
    base = ["plan", *MODEL_FLAGS, "--gpus", "8", "--global-batch-size", "32", "--pp", "4"]
    for kind in sorted({*fields.SCHEDULES_NOT_TRAINED, "auto"}):
        code = main([*base, "--pipeline-schedule", kind])
        err = capsys.readouterr().err
        assert code == 2 and f"--pipeline-schedule {kind}:" in err
    # sharded parameters with the V placement's shared tied embedding: ptdp train refuses it
    fixed = Fixed(
        pipeline_model_parallel_size=4, pipeline_schedule="zb-v", data_parallel_sharding_strategy="optim_grads_params"
    )
    result = search(MODEL, Cluster(A100, 8), 32, fixed=fixed)
    assert all(p.layout.dp == 1 for p in result.plans)  # nothing sharded at dp = 1
    refused = [v.message for _, v in result.rejected if v.rule == "schedule"]
    assert refused and all("optim_grads_params and tied embeddings" in text for text in refused)


def test_train_report_shows_the_bubble_of_the_runs_schedule(tmp_path):
    """A zb-h1 run at pp 4, m 8: the step idles (p - 1) / (3 m) of its work with F = B = W; with a
    hardware profile, the seconds of the step predicted for the run's layout."""
    config = ptdp.load_config(
        world_size=4, tp=1, pp=4, pipeline_schedule="zb-h1", micro_batch_size=1, global_batch_size=8
    )
    per_rank = [
        {"coords": (0, 0, s), "numel": 0, "params": 0, "grads": 0, "optimizer": 0, "peak": 1, "peak_kind": "rss"}
        for s in range(4)
    ]
    check = compare(config, per_rank, None, None)
    assert check["pipeline"] == {"schedule": "zb-h1", "bubble_fraction": pytest.approx(3 / 24)}
    assert "    zb-h1 schedule: the step idles 12.5% of its work with F = B = W (simulated)" in format_comparison(check)
    gpu, profile = CATALOG["h100-sxm"], tmp_path / "profile.json"
    save_profile(profile, gpu, DEFAULT_CONSTANTS, {})
    timed = compare(config, per_rank, 1.0, profile)["pipeline"]
    constants = DEFAULT_CONSTANTS.with_overlap(overlap_grad_reduce=config.parallel.overlap_grad_reduce)
    want = evaluate_performance(config.model, run_candidate(config), Cluster(gpu, 4, 4), constants).time
    assert timed["predicted_bubble_s"] == pytest.approx(want.bubble) and want.bubble > 0
    assert timed["predicted_step_share"] == pytest.approx(want.bubble / want.step)


def test_v_placement_runs_both_edges_on_rank_0():
    """tp 2: rank 0 of zb-v gathers the embedding's output and reduces the output layer's input
    gradient (one tp all-reduce each), where interleaved-1f1b's busiest rank runs one of them."""
    cluster = Cluster(A100, 8)
    zbv = evaluate_performance(MODEL, Candidate.of(2, 4, 1, 1, 32, 2, schedule="zb-v"), cluster).time
    inter = evaluate_performance(MODEL, Candidate.of(2, 4, 1, 1, 32, 2), cluster).time
    assert zbv.compute == pytest.approx(inter.compute) and zbv.tp_comm > inter.tp_comm


def test_searched_zero_bubble_schedules_run_under_the_strategies_ptdp_train_runs_them_with():
    """The search keeps a zero-bubble alternative only under the sharding ptdp train runs it with
    (ZB-V with a tied embedding: not optim_grads_params), and drops it where none; the schedule it
    must plan keeps the first strategy, to be rejected with ptdp train's reason."""
    strategies = ["no_shard", "optim", "optim_grads", "optim_grads_params"]

    def make(sharding, kind="zb-v"):
        return Candidate.of(1, 4, 2, 2, 32, 2 if kind == "zb-v" else 1, schedule=kind, sharding=sharding)

    assert MODEL.tied
    assert layouts._runnable(MODEL, make, strategies, "zb-v", planned=False) == strategies[:3]
    assert layouts._runnable(MODEL, make, ["optim_grads_params"], "zb-v", planned=False) == []
    assert layouts._runnable(MODEL, make, ["optim_grads_params"], "zb-v", planned=True) == ["optim_grads_params"]
    h1 = lambda sharding: make(sharding, "zb-h1")  # noqa: E731
    assert layouts._runnable(MODEL, h1, strategies, "zb-h1", planned=False) == strategies
    one = lambda sharding: make(sharding, "1f1b")  # noqa: E731
    assert layouts._runnable(MODEL, one, strategies, "1f1b", planned=True) == strategies


@pytest.mark.parametrize("kind", fields.SCHEDULES)
def test_the_searchs_schedule_rule_is_ptdp_trains_on_whole_candidates(kind):
    """What the search asks of a schedule and a strategy (cached on them and the tie) is what
    ptdp train's rule says of a whole candidate, at v = 2 and 1, tied or not."""
    untied = dataclasses.replace(MODEL, untie_embeddings_and_output_weights=True)
    for model in (MODEL, untied):
        for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
            for v in (1, 2):
                layout = Candidate.of(1, 4, 2, 1, 32, v, schedule=kind, sharding=strategy)
                whole = not untrained_schedule_rejections(layout.parallel, model)
                assert trains_schedule(kind, strategy, model.tied) == whole, (model.tied, strategy, v)


def test_a_plans_passes_are_the_times_its_bubble_is_simulated_with():
    """A plan's F, B, W and p2p (``Plan.passes``): a middle rank's layers (4 of 16 at pp 4) times one
    layer's passes, W slower by the generation's constant; zb-h1's bubble is its program timed
    with them, and 1F1B's plan has the same passes. No pipeline, no passes."""
    cluster = Cluster(A100, 8)
    zb = evaluate_performance(MODEL, _layout("zb-h1"), cluster)
    assert zb.passes is not None and zb.time.bubble == step_bubble("zb-h1", 4, 16, 1, zb.passes)
    one = evaluate_performance(MODEL, _layout("1f1b"), cluster)
    assert one.passes == zb.passes
    eight = evaluate_performance(MODEL, _layout("1f1b", pp=8), cluster).passes
    assert eight is not None
    for k in ("forward", "backward_input", "backward_weight"):
        assert getattr(zb.passes, k) == pytest.approx(2 * getattr(eight, k))  # 4 layers a rank vs 2
    assert eight.p2p > 0 and zb.passes.p2p > 0  # pp 8 x dp 2 crosses the network: its transfer is slower
    slow = dataclasses.replace(DEFAULT_CONSTANTS, wgrad_arch_efficiency=(("ampere", 0.5),))
    halved = evaluate_performance(MODEL, _layout("zb-h1"), cluster, slow).passes
    assert halved is not None and halved.backward_weight == pytest.approx(2 * zb.passes.backward_weight)
    assert halved.forward == zb.passes.forward
    assert evaluate_performance(MODEL, _layout("1f1b", pp=1), cluster).passes is None


def test_auto_schedule_is_built_from_the_planners_times(tmp_path, capsys):
    """``ptdp plan --json`` records each plan's passes; ``ptdp schedule --pipeline-schedule auto
    --times-from`` builds auto from the best one's, at its pp and m: the same programs and bubble as
    those times given as flags, and the command the text report prints runs."""
    plan_json = tmp_path / "plan.json"
    args = ["plan", *MODEL_FLAGS, "--gpus", "8", "--global-batch-size", "32", "--pp", "4"]
    assert main([*args, "--json"]) == 0
    plan_json.write_text(capsys.readouterr().out)
    best = next(r for r in json.loads(plan_json.read_text()) if r["fits"])
    passes = {k: 1e3 * best["pass_times_s"][k] for k in ("forward", "backward_input", "backward_weight", "p2p")}
    m = best["global_batch_size"] // (best["micro_batch_size"] * best["dp"])
    assert main(["schedule", "--pipeline-schedule", "auto", "--times-from", str(plan_json), "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert (built["pp"], built["num_microbatches"]) == (4, m)
    assert built["bubble"]["times"] == passes
    flags = [f"--time-{k.replace('_', '-')}={t!r}" for k, t in passes.items()]
    assert main(["schedule", "--pipeline-schedule", "auto", "--pp", "4", "-m", str(m), *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == built
    assert main(["schedule", "--pipeline-schedule", "auto", "--pp", "4", "-m", str(m), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] != built["ranks"]  # the times shape the schedule
    assert main(["schedule", "--pipeline-schedule", "zb-h1", "--times-from", str(plan_json), "--json"]) == 0
    h1 = json.loads(capsys.readouterr().out)["bubble"]["simulated"]
    assert built["bubble"]["simulated"] <= h1 + 1e-12  # auto at ZB-H1's memory limit p
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("passes of one microbatch"))
    command = shlex.split(line.split(": ptdp ", 1)[1])
    assert command[:3] == ["schedule", "--pipeline-schedule", "auto"]
    assert main(command) == 0 and "auto: pp=4, num_microbatches=" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pp", "2"], "its times are one rank's layers at pp 4"),
        (["--time-forward", "1"], "give the times one way"),
    ],
)
def test_times_from_a_plan_refuses_what_contradicts_it(tmp_path, capsys, extra, message):
    plan_json = tmp_path / "plan.json"
    assert main(["plan", *MODEL_FLAGS, "--gpus", "8", "--global-batch-size", "32", "--pp", "4", "--json"]) == 0
    plan_json.write_text(capsys.readouterr().out)
    assert main(["schedule", "--pipeline-schedule", "auto", "--times-from", str(plan_json), *extra]) == 2
    assert message in capsys.readouterr().err


def test_times_from_needs_a_plan_with_a_pipeline(tmp_path, capsys):
    plan_json = tmp_path / "plan.json"
    assert main(["plan", *MODEL_FLAGS, "--gpus", "8", "--global-batch-size", "32", "--pp", "1", "--json"]) == 0
    plan_json.write_text(capsys.readouterr().out)
    assert all(r["pass_times_s"] is None for r in json.loads(plan_json.read_text()))
    assert main(["schedule", "--pipeline-schedule", "auto", "--times-from", str(plan_json)]) == 2
    assert "no fitting plan with pipeline pass times" in capsys.readouterr().err
    plan_json.write_text("not json")
    assert main(["schedule", "--times-from", str(plan_json)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_an_moe_layers_w_runs_the_experts_weight_gradients():
    """ptdp train's experts (routed and shared) hand their weight gradients to W: a planned MoE
    model's W is the attention's (flops.layer_wgrad_time, no MLP in an MoE layer) plus the
    experts' (SublayerTimes.wgrad), and B is that much shorter than a whole backward."""
    from ptdp.config.moe import MoEConfig
    from ptdp.planner.inputs.moe_model import moe_model
    from ptdp.planner.time.constants import links_for
    from ptdp.planner.time.moe_time import sublayer_times
    from ptdp.planner.time.stages import layer_passes, layer_terms

    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=512)
    model = moe_model(MODEL, moe)
    cluster = Cluster(A100, 8)
    layout = Candidate.of(1, 4, 2, 1, 32, 1, "none", False, schedule="zb-h1", sharding="optim", ep=2)
    c = DEFAULT_CONSTANTS.for_gpu(A100)
    peak, bandwidth, links = (
        A100.sustained_peak("bf16"),
        A100.memory_bandwidth * c.hbm_efficiency,
        links_for(cluster, c),
    )
    f, b, w = layer_passes(model, layout, peak, bandwidth, links, c, 2.0)
    sub = sublayer_times(model, 1, 1, 2, 1, 1, False, "alltoall", layout.modules, False, peak, bandwidth, c, links, 2.0)
    dense_w = flops.layer_wgrad_time(model, 1, 1, peak, bandwidth, c.gemm_peak_fraction, c.gemm_half_dim)
    assert sub.wgrad > 0 and w == pytest.approx(dense_w + sub.wgrad)
    t = layer_terms(model, layout, peak, bandwidth, links, c, 2.0)
    assert f + b + w == pytest.approx(t.compute + t.recompute + t.tp_comm + t.cp_comm + t.ep_comm)
    plan = evaluate_performance(model, layout, cluster)
    assert plan.passes is not None and plan.passes.backward_weight == pytest.approx(4 * w)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"dp": 0}, "dp 0"),
        ({"pass_times_s": {"forward": "a", "backward_input": 1, "backward_weight": 1, "p2p": 0}}, "forward 'a'"),
        (
            {"pass_times_s": {"forward": 1, "backward_input": 1, "backward_weight": 0, "p2p": 0}},
            "F, B and W must be > 0",
        ),
        ({"pass_times_s": {"forward": 1, "backward_input": 1, "backward_weight": 1, "p2p": -1}}, ">= 0"),
    ],
)
def test_times_from_a_hand_edited_plan_names_what_is_wrong(tmp_path, capsys, edit, message):
    plan_json = tmp_path / "plan.json"
    assert main(["plan", *MODEL_FLAGS, "--gpus", "8", "--global-batch-size", "32", "--pp", "4", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    records[0].update(edit)
    plan_json.write_text(json.dumps(records))
    assert main(["schedule", "--pipeline-schedule", "auto", "--times-from", str(plan_json)]) == 2
    assert message in capsys.readouterr().err


def test_a_fixed_v_schedule_counts_the_embedding_and_loss_when_the_layers_do_not_split():
    """14 layers over 2 x 4 chunks: zb-v fixed plans the splits with the embedding and the loss
    counted as layers, as the flags that count them do."""
    model = gpt(num_layers=14, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=51200)
    fixed = Fixed(pipeline_model_parallel_size=4, pipeline_schedule="zb-v")
    found = search(model, Cluster(A100, 8), 32, fixed=fixed)
    counted = dataclasses.replace(
        fixed, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    )
    given = search(model, Cluster(A100, 8), 32, fixed=counted)
    assert found.plans and {p.layout.parallel.schedule for p in found.plans} == {"zb-v"}
    assert found.plans[0].layout == given.plans[0].layout and found.plans[0].time == given.plans[0].time
