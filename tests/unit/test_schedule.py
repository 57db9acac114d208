"""Invariant 3: schedules are pure data and provably correct (no processes)."""

from __future__ import annotations

import pytest

from ptdp.spec import ConfigError
from ptdp.engine.pipeline.partition import chunk_layer_ids, stage_layer_ids
from ptdp.engine.pipeline.schedule import Action, build_schedule, transfer_batches
from ptdp.engine.pipeline.verify import ScheduleError, check_schedule, ideal_idle_time, in_flight_bound, simulate


CASES = [(kind, p, m, v) for kind in ("gpipe", "1f1b", "interleaved-1f1b", "forward-only")
         for p in (1, 2, 3, 4, 8) for m in range(1, 17) for v in (1, 2, 3)
         if (v == 1 or kind in ("interleaved-1f1b", "forward-only"))
         and (kind != "interleaved-1f1b" or (p >= 2 and m % p == 0))
         and (kind != "forward-only" or v == 1 or m % p == 0)]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_every_schedule_is_correct_and_meets_its_bubble(kind, p, m, v):
    schedule = build_schedule(kind, p, m, v)
    assert len(schedule) == p
    check_schedule(schedule, m, virtual_stages=v, max_in_flight=[in_flight_bound(kind, p, m, v, r) for r in range(p)])
    if kind != "forward-only":
        timeline = simulate(schedule, virtual_stages=v, forward_time=1.0, backward_time=2.0)
        assert timeline.idle == pytest.approx([ideal_idle_time(p, v, 1.0, 2.0)] * p)
        assert timeline.makespan == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)


def test_in_flight_bounds():
    def peak(acts):
        live = top = 0
        for a in acts:
            live += {"forward": 1, "backward": -1}.get(a.kind, 0)
            top = max(top, live)
        return top
    p, m = 4, 8
    assert [peak(a) for a in build_schedule("1f1b", p, m)] == [4, 3, 2, 1]
    assert [peak(a) for a in build_schedule("gpipe", p, m)] == [8, 8, 8, 8]
    assert [peak(a) for a in build_schedule("interleaved-1f1b", p, m, 2)] == [11, 9, 7, 5]
    with pytest.raises(ScheduleError, match="in flight"):
        check_schedule(build_schedule("gpipe", p, m), m, max_in_flight=[in_flight_bound("1f1b", p, m, 1, r) for r in range(p)])


def test_steady_state_pairs_send_with_receive():
    rank0 = build_schedule("1f1b", 2, 3)[0]
    batches = [[(a.kind, a.microbatch) for a in s] for s in transfer_batches(rank0) if len(s) > 1]
    assert [("send_forward", 1), ("recv_backward", 0)] in batches


def test_interleaved_rank_order_takes_microbatch_groups_through_chunks():
    rank0 = [(a.microbatch, a.chunk) for a in build_schedule("interleaved-1f1b", 2, 4, 2)[0] if a.kind == "forward"]
    assert rank0 == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def test_checker_finds_deadlock_mismatch_and_bad_order():
    deadlock = [
        [Action("recv_backward", 0), Action("forward", 0), Action("send_forward", 0), Action("backward", 0)],
        [Action("recv_forward", 0), Action("forward", 0), Action("backward", 0), Action("send_backward", 0)],
    ]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(deadlock, 1)
    mismatched = [
        [Action("forward", 0), Action("forward", 1), Action("send_forward", 1), Action("send_forward", 0)],
        [Action("recv_forward", 0), Action("forward", 0), Action("recv_forward", 1), Action("forward", 1)],
    ]
    with pytest.raises(ScheduleError, match="paired with microbatch"):
        check_schedule(mismatched, 2)
    with pytest.raises(ScheduleError, match="before its forward"):
        check_schedule([[Action("backward", 0), Action("forward", 0)]], 1)
    with pytest.raises(ScheduleError, match="microbatch 1 chunk 0 has no backward"):
        check_schedule([[Action("forward", 0), Action("backward", 0), Action("forward", 1)]], 2)
    # a schedule whose second chunk waits for an activation nobody sends
    broken = build_schedule("interleaved-1f1b", 2, 2, 2)
    broken[0] = [a for a in broken[0] if not (a.kind == "send_forward" and a.chunk == 1)]
    with pytest.raises(ScheduleError):
        check_schedule(broken, 2, virtual_stages=2)


def test_build_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_microbatches % pp == 0: pp=4, num_microbatches=6"):
        build_schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs interleaved-1f1b"):
        build_schedule("1f1b", 2, 4, 2)


def test_layer_assignment_covers_every_layer_once():
    assert [stage_layer_ids(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [list(stage_layer_ids(5, 2, r, (3, 2))) for r in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError, match="num_layers=5 is not divisible"):
        stage_layer_ids(5, 2, 0)
    owned = sorted(i for r in range(4) for c in range(3) for i in chunk_layer_ids(24, 4, 3, r, c))
    assert owned == list(range(24))
    assert list(chunk_layer_ids(24, 4, 3, 1, 2)) == [18, 19]  # virtual stage 2 * 4 + 1 = 9, 2 layers each
    with pytest.raises(ValueError, match="not divisible by pp\\*v"):
        chunk_layer_ids(10, 2, 3, 0, 0)


def test_runtime_rejects_microbatches_of_the_wrong_shape():
    import torch

    from ptdp.engine.comm import AxisGroup
    from ptdp.engine.pipeline.runtime import run_schedule

    actions = build_schedule("1f1b", 1, 2)[0]
    good = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    short = (torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"microbatch 1 has tokens \(2, 7\).*expected \[micro_batch_size, seq_length\] = \[2, 8\]"):
        run_schedule(actions, torch.nn.Identity(), [good, short], pp=AxisGroup.single("pp"), hidden_shape=(2, 8, 4),
                     dtype=torch.float32, device=torch.device("cpu"))
