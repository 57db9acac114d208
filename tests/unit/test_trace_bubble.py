"""The measured bubble counts every compute of a schedule (F, a whole backward, B and W) as busy
and the rest of the schedule's span as idle; the activity phases take B and W."""

from __future__ import annotations

import pytest

from ptdp.engine import activity
from ptdp.layout.pipeline.schedule import Action
from ptdp.run.trace import Tracer, bubble_by_rank


def _event(cat: str, ts: float, dur: float) -> dict:
    return {"pid": 0, "cat": cat, "ts": ts, "dur": dur, "args": {"iteration": 1}}


def test_b_and_w_are_compute_time():
    events = [
        _event("forward", 0, 10),
        _event("transfer", 10, 5),
        _event("backward_input", 15, 10),
        _event("backward_weight", 25, 10),
        _event("backward", 40, 20),
    ]
    # span 60, compute 50: idle 10
    assert bubble_by_rank(events) == {0: pytest.approx(10 / 50)}


@pytest.mark.parametrize("kind,name", [("backward_input", "Bi3.1"), ("backward_weight", "W3.1"), ("forward", "F3.1")])
def test_spans_of_b_and_w_are_computes(kind, name):
    span = Tracer(0, 0, "cpu").span([Action(kind, 3, 1)])
    assert (span.name, span.cat) == (name, kind)


def test_activity_has_the_zero_bubble_phases():
    for kind in ("backward_input", "backward_weight"):
        assert kind in activity.PHASES
