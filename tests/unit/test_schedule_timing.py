"""Schedules simulated with measured F, B, W and p2p times, and the bubble rate of Qi et al.,
"Zero Bubble Pipeline Parallelism" (arXiv:2401.10241): (span - m (F + B + W)) / span."""

from __future__ import annotations

import itertools

import pytest

from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.program import DURATION, build_programs, program_makespan
from ptdp.layout.pipeline.schedule import COMPUTE, HANDOVER, Action, build_schedule
from ptdp.layout.pipeline.timing import StageTimes, compute_times, dependencies, simulate_times
from ptdp.layout.pipeline.verify import check_schedule

#: the paper's Table 9, 1.5B model, p = 8 (ms)
TABLE_9 = StageTimes(forward=18.522, backward_input=18.086, backward_weight=9.337, p2p=0.601)


@pytest.mark.parametrize("kind,rate", [("1f1b", 0.2431), ("zb-h1", 0.1585)])
def test_reproduces_table_5(kind, rate):
    """Table 5, 1.5B, p = 8, m = 24: 1F1B 0.2431, ZB-H1 0.1585. The p2p time is added on each
    dependency between ranks, so 1F1B's steady state waits 2 p2p per microbatch on the last rank."""
    run = simulate_times(build_schedule(kind, 8, 24), TABLE_9)
    assert round(run.bubble_rate, 4) == rate


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zero_bubble_kinds_meet_their_bubbles_under_equal_times(p, extra):
    """F = B = W = t, free transfers, the longest rank's idle time: ZB-H1 (p - 1) t (1F1B's is
    3 (p - 1) t), ZB-H2 0 from m = 2p, ZB-V 0 from m = 2p - 1 (Qi et al. §2, §6)."""
    t = StageTimes(forward=1, backward_input=1, backward_weight=1)

    def idle(kind, m, v=1):
        return (
            max(simulate_times(build_schedule(kind, p, m, v), t, virtual_stages=v, placement=placement_of(kind)).spans)
            - 3 * m
        )

    assert idle("zb-h1", p + extra) == pytest.approx(p - 1)
    assert idle("zb-h2", 2 * p + extra) == pytest.approx(0)
    assert idle("zb-v", 2 * p - 1 + extra, 2) == pytest.approx(0)
    # its pairs timed one after the other (no overlap): half a stage's F + B + W per rank but one
    assert idle("dualpipev", 2 * p + extra, 2) == pytest.approx((p - 1) / 2)


def test_dualpipev_phases_on_the_last_rank():
    """p = 2, m = 4, rank 1: F0 F1 twice (no phase 1, 3, 5 or 7 on the last rank), the overlapped
    pairs (F0, whole backward 1) and (F1, whole backward 0) twice, the last two backwards of each
    chunk (r odd: split from the second pair's chunk-1 one), the two Ws in the Bs' order. A whole
    backward is its B then its W at once."""
    order = [(a.kind, a.microbatch, a.chunk) for a in build_schedule("dualpipev", 2, 4, 2)[1] if a.kind in COMPUTE]
    f, b, w = "forward", "backward_input", "backward_weight"
    assert order == [
        (f, 0, 0), (f, 0, 1), (f, 1, 0), (f, 1, 1),
        (f, 2, 0), (b, 0, 1), (w, 0, 1), (f, 2, 1), (b, 0, 0), (w, 0, 0),
        (f, 3, 0), (b, 1, 1), (w, 1, 1), (f, 3, 1), (b, 1, 0), (w, 1, 0),
        (b, 2, 1), (w, 2, 1), (b, 2, 0), (w, 2, 0), (b, 3, 1), (b, 3, 0),
        (w, 3, 1), (w, 3, 0),
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "auto"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_programs_run_in_their_simulated_time(kind, p):
    """The runtime's programs, run as the runtime runs them (groups posted in order, each waited
    for when a compute needs what it received), take the free-transfer simulation's time with F,
    B, W of one unit: grouping holds no rank back."""
    v = 1 if kind in ("gpipe", "1f1b", "zb-h1", "zb-h2", "auto") else 2
    ms = (
        (2 * p, 3 * p, 4 * p) if kind == "interleaved-1f1b" else (2 * p, 3 * p + 1, 1 if kind != "dualpipev" else 4 * p)
    )
    for m in ms:
        programs = [list(x) for x in build_programs(kind, p, m, v)]
        grouped = program_makespan(programs, lambda s: 0 if s.kind in HANDOVER else DURATION[s.kind])
        _, end = compute_times(build_schedule(kind, p, m, v), DURATION, virtual_stages=v, placement=placement_of(kind))
        assert grouped == max(end.values()), (kind, p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 24)])
def test_equal_times_give_the_formula_bubbles(p, m):
    """F = B = W = t (p2p free): 1F1B's longest rank idles 3 (p - 1) t, interleaved's 3 (p - 1) t / v."""
    t = StageTimes(forward=1, backward_input=1, backward_weight=1)
    run = simulate_times(build_schedule("1f1b", p, m), t)
    assert max(run.spans) - 3 * m == pytest.approx(3 * (p - 1))
    assert run.bubble_rate == pytest.approx(3 * (p - 1) / (3 * m + 3 * (p - 1)))
    run = simulate_times(build_schedule("interleaved-1f1b", p, m, 2), t, virtual_stages=2)
    assert max(run.spans) - 3 * m == pytest.approx(3 * (p - 1) / 2)


def test_events_follow_each_ranks_order_and_dependencies():
    run = simulate_times(build_schedule("gpipe", 2, 2), StageTimes(2, 1, 1, 0.5))
    assert [(a.kind, a.microbatch, s, e) for a, s, e in run.events[1]] == [
        ("forward", 0, 2.5, 4.5),
        ("forward", 1, 4.5, 6.5),
        ("backward", 0, 6.5, 8.5),
        ("backward", 1, 8.5, 10.5),
    ]
    assert run.makespan == 13.0 and run.busy == [8.0, 8.0]


def _held_until_w(schedule) -> int:
    """Most microbatches a rank holds, each from its forward to its W (what the auto schedule's limit counts)."""
    return max(
        max(itertools.accumulate(1 if a.kind == "forward" else -(a.kind == "backward_weight") for a in acts))
        for acts in schedule
    )


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_auto_matches_the_handcrafted_schedules_under_equal_times(p):
    """The heuristic within 1F1B's memory (p) finds ZB-H1's bubble, within 2p - 1 microbatches none."""
    t = StageTimes(forward=1, backward_input=1, backward_weight=1)
    for m in (p, 2 * p, 3 * p):
        one = build_schedule("auto", p, m, times=t, memory_limit=p)
        assert max(simulate_times(one, t).spans) - 3 * m == pytest.approx(p - 1)
        assert _held_until_w(one) <= p
    two = build_schedule("auto", p, 2 * p, times=t, memory_limit=2 * p - 1)
    assert max(simulate_times(two, t).spans) == pytest.approx(3 * 2 * p)
    assert _held_until_w(two) <= 2 * p - 1


def test_auto_with_table_9_times():
    """p = 8, m = 24 with the 1.5B model's times: within p microbatches ZB-H1's 0.1585, within 2p - 1 0.1083."""
    for limit, rate in ((8, 0.1585), (15, 0.1083)):
        schedule = build_schedule("auto", 8, 24, times=TABLE_9, memory_limit=limit)
        assert round(simulate_times(schedule, TABLE_9).bubble_rate, 4) == rate


@pytest.mark.parametrize("times", [TABLE_9, StageTimes(1, 2, 0.5, 0.3), StageTimes(3, 1, 1, 2)])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_auto_is_correct_within_its_memory_limit(times, p):
    """Every limit from 1 microbatch up, uneven times and slow links: correct, deadlock-free under
    NCCL's rules, never holding more than the limit."""
    for m in (1, 2, 5, 13):
        for limit in sorted({1, 2, p, 2 * p - 1, 3 * p}):
            schedule = build_schedule("auto", p, m, times=times, memory_limit=limit)
            check_schedule(schedule, m, max_in_flight=[limit] * p)
            build_programs("auto", p, m, times=times, memory_limit=limit)
            assert _held_until_w(schedule) <= limit


def test_auto_refuses_a_memory_limit_below_one_microbatch():
    with pytest.raises(ValueError, match="memory limit is 0 microbatches; it must be >= 1"):
        build_schedule("auto", 2, 4, memory_limit=0)


@pytest.mark.parametrize(
    "kind,p,m,v",
    [
        ("gpipe", 3, 5, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("zb-h1", 4, 9, 1),
        ("zb-h2", 3, 7, 1),
        ("zb-v", 4, 6, 2),
        ("dualpipev", 3, 7, 2),
    ],
)
def test_compiled_dependencies_time_a_schedule_as_compute_times(kind, p, m, v):
    """One pass over the compiled computes gives every compute's end, the step's idle time (the
    last end less the busiest rank's work) and the longest rank's own idle time, as the
    simulation does, under uneven times and a slow link."""
    schedule = build_schedule(kind, p, m, v)
    placement = placement_of(kind)
    graph = dependencies(schedule, virtual_stages=v, placement=placement)
    for times in (StageTimes(1.3, 0.7, 0.4, 0.0), StageTimes(0.5, 1.9, 1.1, 0.35)):
        run = simulate_times(schedule, times, virtual_stages=v, placement=placement)
        _, end = compute_times(schedule, times.durations(v), virtual_stages=v, placement=placement, p2p=times.p2p)
        assert sorted(graph.ends(times.durations(v), times.p2p)) == pytest.approx(sorted(end.values()))
        assert graph.idle(times, v) == pytest.approx(run.makespan - max(run.busy))
        longest = max(range(p), key=run.spans.__getitem__)
        assert graph.idle(times, v, synchronous=False) == pytest.approx(run.spans[longest] - run.busy[longest])


def test_compiled_dependencies_refuse_a_cycle():
    """Rank 0's backward waiting for rank 1's, which waits for rank 0's forward after it."""
    cycle = [[Action("backward", 0), Action("forward", 0)], [Action("forward", 0), Action("backward", 0)]]
    with pytest.raises(ValueError, match="wait on each other: rank 0 at backward .*; rank 1 at forward"):
        dependencies(cycle)
