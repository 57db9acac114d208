"""The search's ranking of fitting plans: plans whose zero-bubble schedule is simulated only when
the ranking reaches them come out as if every plan had been timed first."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ptdp.planner.candidate import Candidate, Plan, TimeBreakdown
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import gpt
from ptdp.planner.search import layouts
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.search.ranking import Pending, RankedPlans, fastest

A100 = CATALOG["a100-80gb"]
MODEL = gpt(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)


def _plan(step: float, tag: int) -> Plan:
    layout = Candidate.of(1, 1, 1, 1, tag + 1)  # the batch tells plans apart
    return Plan(layout, True, time=TimeBreakdown(step, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


class _Counted:
    def __init__(self, plan: Plan) -> None:
        self.plan, self.calls = plan, 0

    def __call__(self) -> Plan:
        self.calls += 1
        return self.plan


def _mixed(seed: int, n: int = 60) -> tuple[list[Plan | Pending], list[Plan], list[_Counted]]:
    """Plans and pending plans (bounds at most their steps, ties included), and the eager ranking:
    every plan timed, then a stable sort by step."""
    rng = random.Random(seed)
    items: list[Plan | Pending] = []
    plans, counters = [], []
    for i in range(n):
        plan = _plan(float(rng.choice([1, 2, 2, 3, 5, 8, 13])), i)
        plans.append(plan)
        if rng.random() < 0.5:
            counter = _Counted(plan)
            counters.append(counter)
            items.append(Pending(plan.need_time().step - rng.choice([0.0, 0.0, 0.5, 1.0, 4.0]), counter))
        else:
            items.append(plan)
    return items, sorted(plans, key=lambda p: p.need_time().step), counters


@pytest.mark.parametrize("seed", range(6))
def test_ranked_plans_equal_timing_every_plan_first(seed):
    """Indexing, slicing, iteration, len and + give the stable sort of the timed plans; each
    pending plan is timed at most once."""
    items, eager, counters = _mixed(seed)
    ranked = RankedPlans(items)
    assert len(ranked) == len(eager)
    assert ranked[0] == eager[0] and ranked[:5] == eager[:5] and ranked[-1] == eager[-1]
    assert list(ranked) == eager and ranked == eager and ranked + [] == eager and [] + ranked == eager
    assert ranked[::2] == eager[::2] and ranked[3:9] == eager[3:9]
    assert all(c.calls == 1 for c in counters)
    with pytest.raises(IndexError):
        ranked[len(eager)]


def test_the_first_plans_time_only_the_pending_ones_ranked_before_them():
    """Reading the best plan times no pending plan whose bound is above it."""
    fast = _plan(1.0, 0)
    slow = [_Counted(_plan(10.0 + i, i + 1)) for i in range(5)]
    ranked = RankedPlans([*(Pending(9.5 + i, c) for i, c in enumerate(slow)), fast])
    assert ranked[0] == fast and sum(c.calls for c in slow) == 0
    assert ranked[1] == slow[0].plan and [c.calls for c in slow] == [1, 0, 0, 0, 0]
    assert len(ranked) == 6 and sum(c.calls for c in slow) == 1


def test_fastest_of_pending_splits_is_the_first_of_the_fastest_and_skips_slower_bounds():
    first, tie, slow = _Counted(_plan(3.0, 0)), _Counted(_plan(3.0, 1)), _Counted(_plan(9.0, 2))
    assert fastest([Pending(2.0, first), Pending(3.0, tie), Pending(4.0, slow)]) == first.plan
    assert (first.calls, tie.calls, slow.calls) == (1, 1, 0)


def test_a_search_ranks_as_if_every_zero_bubble_plan_were_simulated_first(monkeypatch):
    """The same plans, times and order as a ranking that times every pending plan up front, with
    zero-bubble plans among the first; reading the ten best times under half of the pending plans."""
    fixed = Fixed(pipeline_model_parallel_size=4)
    cluster = Cluster(dataclasses.replace(A100, memory_bytes=16 * 2**30), 32)
    calls = []
    timed = Pending.__init__

    def counting(self, bound, plan_of):
        def once():
            calls.append(bound)
            return plan_of()

        timed(self, bound, once)

    monkeypatch.setattr(Pending, "__init__", counting)
    lazy = search(MODEL, cluster, 64, fixed=fixed)
    top = lazy.plans[:10]
    read_first = len(calls)
    lazy_all = list(lazy.plans)
    calls_all = len(calls)
    monkeypatch.setattr(
        layouts,
        "RankedPlans",
        lambda found: sorted(
            (f.timed() if isinstance(f, Pending) else f for f in found), key=lambda p: p.need_time().step
        ),
    )
    eager = search(MODEL, cluster, 64, fixed=fixed)
    assert [(p.layout, p.time) for p in lazy_all] == [(p.layout, p.time) for p in eager.plans]
    assert top == eager.plans[:10]
    assert {"zb-h1", "zb-h2"} & {p.layout.parallel.schedule for p in top}
    assert 0 < read_first < calls_all / 2 < len(lazy.plans)
