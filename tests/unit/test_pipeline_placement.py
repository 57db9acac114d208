"""The V placement, the local hand-over at its turn, and split backwards (B and W) as data."""

from __future__ import annotations

import pytest

from ptdp.layout.pipeline.nccl_model import ScheduleError, simulate_nccl
from ptdp.layout.pipeline.partition import pipeline_split
from ptdp.layout.pipeline.placement import stage_owner, virtual_stage
from ptdp.layout.pipeline.program import P2PGroup, programs_from_schedule
from ptdp.layout.pipeline.schedule import Action, peer, with_transfers
from ptdp.layout.pipeline.verify import check_schedule


@pytest.mark.parametrize("placement,v", [("looped", 1), ("looped", 3), ("v", 2)])
@pytest.mark.parametrize("p", [1, 2, 5])
def test_stage_owner_inverts_virtual_stage(placement, v, p):
    stages = [virtual_stage(r, c, p, placement) for r in range(p) for c in range(v)]
    assert sorted(stages) == list(range(p * v))
    assert all(
        stage_owner(virtual_stage(r, c, p, placement), p, placement) == (r, c) for r in range(p) for c in range(v)
    )


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    assert [[virtual_stage(r, c, 4, "v") for c in range(2)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    split = pipeline_split(16, 4, v=2, placement="v")
    assert [list(split.chunk_layer_ids(r, c)) for r in (0, 3) for c in range(2)] == [
        [0, 1],
        [14, 15],
        [6, 7],
        [8, 9],
    ]
    assert split.chunk_layers == [2] * 8
    counted = pipeline_split(14, 4, v=2, embedding=True, loss=True, placement="v")
    assert counted.layer_split == (2, 4, 4, 4)  # rank 0: the embedding's and the loss's chunks


def _split_gpipe(p: int, m: int, placement: str, v: int) -> list[list[Action]]:
    """Every forward in virtual-stage order, then every B in reverse, then the Ws."""
    schedule = []
    for r in range(p):
        chunks = sorted(range(v), key=lambda c: virtual_stage(r, c, p, placement))
        order = [("forward", i, c) for c in chunks for i in range(m)]
        order += [("backward_input", i, c) for c in reversed(chunks) for i in range(m)]
        order += [("backward_weight", i, c) for c in reversed(chunks) for i in range(m)]
        schedule.append(with_transfers(order, r, p, v, placement))
    return schedule


@pytest.mark.parametrize("p,m", [(1, 2), (2, 3), (4, 4)])
def test_the_v_turn_is_a_local_handover_and_neighbours_trade_both_ways(p, m):
    schedule = _split_gpipe(p, m, "v", 2)
    last = schedule[p - 1]
    assert Action("handover_forward", 0, 1) in last and Action("handover_backward", 0, 0) in last
    assert Action("send_forward", 0, 0) not in last and Action("recv_forward", 0, 1) not in last
    check_schedule(schedule, m, virtual_stages=2, placement="v")
    programs = programs_from_schedule(schedule, 2, "v")
    simulate_nccl(programs)
    if p > 1:  # rank 0 sends chunk 0's activations to rank 1 and chunk 1's input gradients too
        ops = {
            (o.op, o.peer, o.tag.split(":")[0], o.tag.split(":")[2])
            for s in programs[0]
            if isinstance(s, P2PGroup)
            for o in s.ops
        }
        assert ops == {
            ("send", 1, "act", "vs0"),
            ("send", 1, "grad", f"vs{2 * p - 1}"),
            ("recv", 1, "act", f"vs{2 * p - 2}"),
            ("recv", 1, "grad", "vs1"),
        }
    if p == 4:  # rank 1's chunk 1 is stage 6: activations to stage 7 on rank 0, gradients to stage 5 on rank 2
        assert peer(Action("send_forward", 0, 1), 1, p, "v") == 0
        assert peer(Action("send_backward", 0, 1), 1, p, "v") == 2


def test_checker_rejects_w_before_b_and_a_b_without_w():
    acts = [Action("forward", 0), Action("backward_weight", 0), Action("backward_input", 0)]
    with pytest.raises(ScheduleError, match="backward_weight of microbatch 0 chunk 0 before its backward_input"):
        check_schedule([acts], 1)
    with pytest.raises(ScheduleError, match="no backward_weight after its B"):
        check_schedule([[Action("forward", 0), Action("backward_input", 0)]], 1)
    with pytest.raises(ScheduleError, match="has a backward and a B"):
        check_schedule([[Action("forward", 0), Action("backward", 0), Action("backward_input", 0)]], 1)
    with pytest.raises(ScheduleError, match="stage 0 is not here"):
        check_schedule([[Action("forward", 0)], [Action("handover_forward", 0), Action("forward", 0)]], 1)


def test_in_flight_counts_an_activation_until_its_b():
    acts = [Action("forward", 0), Action("forward", 1), Action("backward_input", 0), Action("backward_input", 1)]
    acts += [Action("backward_weight", 0), Action("backward_weight", 1)]
    check_schedule([acts], 2, max_in_flight=[2])
    with pytest.raises(ScheduleError, match="2 microbatches in flight > bound 1"):
        check_schedule([acts], 2, max_in_flight=[1])
