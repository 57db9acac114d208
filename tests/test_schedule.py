"""Invariant 3: schedules are pure data and provably correct (no processes)."""

from __future__ import annotations

import pytest

from ptdp.pipeline.partition import stage_layer_ids
from ptdp.pipeline.schedule import Action, ScheduleError, build_schedule, check_schedule, transfer_batches
from ptdp.config import ConfigError


def bound(kind: str, p: int, m: int) -> list[int]:
    return [min(p - r, m) if kind == "1f1b" else m for r in range(p)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "forward-only"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16])
def test_built_schedules_are_correct(kind, p, m):
    schedule = build_schedule(kind, p, m)
    assert len(schedule) == p
    check_schedule(schedule, m, max_in_flight=bound(kind, p, m))


def test_1f1b_keeps_at_most_p_in_flight_and_gpipe_keeps_m():
    p, m = 4, 8
    def peak(acts):
        live = top = 0
        for a in acts:
            live += {"forward": 1, "backward": -1}.get(a.kind, 0)
            top = max(top, live)
        return top
    assert [peak(a) for a in build_schedule("1f1b", p, m)] == [4, 3, 2, 1]
    assert [peak(a) for a in build_schedule("gpipe", p, m)] == [8, 8, 8, 8]
    with pytest.raises(ScheduleError, match="in flight"):
        check_schedule(build_schedule("gpipe", p, m), m, max_in_flight=bound("1f1b", p, m))


def test_1f1b_steady_state_pairs_send_with_receive():
    rank0 = build_schedule("1f1b", 2, 3)[0]
    batches = [[(a.kind, a.microbatch) for a in s] for s in transfer_batches(rank0) if len(s) > 1]
    assert [("send_forward", 1), ("recv_backward", 0)] in batches


def test_checker_finds_deadlock():
    # a receive posted together with the send it waits behind is fine (one batch) ...
    batched = [
        [Action("forward", 0), Action("recv_backward", 0), Action("send_forward", 0), Action("backward", 0)],
        [Action("recv_forward", 0), Action("forward", 0), Action("backward", 0), Action("send_backward", 0)],
    ]
    check_schedule(batched, 1)
    swapped = [
        [Action("forward", 0), Action("send_forward", 0)],
        [Action("recv_forward", 0), Action("forward", 0)],
    ]
    check_schedule(swapped, 1)
    # ... but a receive separated from the send by compute waits forever
    deadlock = [
        [Action("recv_backward", 0), Action("forward", 0), Action("send_forward", 0), Action("backward", 0)],
        [Action("recv_forward", 0), Action("forward", 0), Action("backward", 0), Action("send_backward", 0)],
    ]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(deadlock, 1)


def test_checker_finds_mismatched_microbatch_and_bad_order():
    mismatched = [
        [Action("forward", 0), Action("forward", 1), Action("send_forward", 1), Action("send_forward", 0)],
        [Action("recv_forward", 0), Action("forward", 0), Action("recv_forward", 1), Action("forward", 1)],
    ]
    with pytest.raises(ScheduleError, match="paired with microbatch"):
        check_schedule(mismatched, 2)
    backward_first = [[Action("backward", 0), Action("forward", 0)]]
    with pytest.raises(ScheduleError, match="before its forward"):
        check_schedule(backward_first, 1)
    missing = [[Action("forward", 0), Action("backward", 0), Action("forward", 1)]]
    with pytest.raises(ScheduleError, match="microbatch 1 has no backward"):
        check_schedule(missing, 2)


def test_build_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        build_schedule("1f1b", 2, 0)


def test_stage_layer_ids_cover_every_layer_once():
    assert [stage_layer_ids(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [list(stage_layer_ids(5, 2, r, (3, 2))) for r in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError, match="num_layers=5 is not divisible"):
        stage_layer_ids(5, 2, 0)
