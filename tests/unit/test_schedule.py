"""Invariant 3: schedules are pure data and provably correct (no processes)."""

from __future__ import annotations

import pytest

from ptdp.errors import ConfigError
from ptdp.layout.pipeline.nccl_model import ScheduleError
from ptdp.layout.pipeline.partition import chunk_layer_ids, stage_layer_ids
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.program import P2PGroup, build_programs
from ptdp.layout.pipeline.schedule import Action, build_schedule
from ptdp.layout.pipeline.verify import check_schedule, ideal_idle_time, in_flight_bound, simulate

CASES = [
    (kind, p, m, v)
    for kind in ("gpipe", "1f1b", "interleaved-1f1b", "forward-only")
    for p in (1, 2, 3, 4, 8)
    for m in range(1, 17)
    for v in (1, 2, 3)
    if (v == 1 or kind in ("interleaved-1f1b", "forward-only"))
    and (kind != "interleaved-1f1b" or (p >= 2 and m % p == 0))
    and (kind != "forward-only" or v == 1 or (p >= 2 and m % p == 0))
] + [
    (kind, p, m, 2 if placement_of(kind) == "v" else 1)
    for kind in ("zb-h1", "zb-h2", "zb-v", "dualpipev", "auto")
    for p in (1, 2, 3, 4, 8)
    for m in range(1, 17)
    if kind != "dualpipev" or m >= 2 * p
]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_every_schedule_is_correct_and_meets_its_bubble(kind, p, m, v):
    """Every shape the checks accept (the zero-bubble kinds' bubbles: tests/unit/test_schedule_timing.py)."""
    schedule = build_schedule(kind, p, m, v)
    assert len(schedule) == p
    bounds = [in_flight_bound(kind, p, m, v, r) for r in range(p)]
    check_schedule(schedule, m, virtual_stages=v, max_in_flight=bounds, placement=placement_of(kind))
    if kind in ("gpipe", "1f1b", "interleaved-1f1b"):
        timeline = simulate(schedule, virtual_stages=v, forward_time=1.0, backward_time=2.0)
        assert timeline.idle == pytest.approx([ideal_idle_time(p, v, 1.0, 2.0)] * p)
        assert timeline.makespan == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)


def test_in_flight_bounds():
    def peak(acts, until=("backward", "backward_input")):
        live = top = 0
        for a in acts:
            live += 1 if a.kind == "forward" else -(a.kind in until)
            top = max(top, live)
        return top

    p, m = 4, 8
    assert [peak(a) for a in build_schedule("1f1b", p, m)] == [4, 3, 2, 1]
    assert [peak(a) for a in build_schedule("gpipe", p, m)] == [8, 8, 8, 8]
    assert [peak(a) for a in build_schedule("interleaved-1f1b", p, m, 2)] == [11, 9, 7, 5]
    # activations held until B (Qi et al.'s M_B): ZB-H1 p, ZB-H2 2p - 1, ZB-V 2p chunks = p microbatches
    assert [peak(a) for a in build_schedule("zb-h1", p, m)] == [4, 3, 2, 1]
    assert [peak(a) for a in build_schedule("zb-h2", p, m)] == [7, 5, 3, 1]
    assert [peak(a) for a in build_schedule("zb-v", p, m, 2)] == [8, 8, 8, 8]
    assert [peak(a) for a in build_schedule("dualpipev", p, m, 2)] == [9, 9, 9, 9]  # 2p + 1, DualPipe's PP + 1
    # counted until W (what a B leaves for its W stays until then): every rank at the bound, ZB-H2 one more
    until_w = ("backward", "backward_weight")
    assert [peak(a, until_w) for a in build_schedule("zb-h1", p, m)] == [4, 4, 4, 4]
    assert [peak(a, until_w) for a in build_schedule("zb-h2", p, m)] == [8, 8, 8, 8]
    assert [peak(a, until_w) for a in build_schedule("zb-v", p, m, 2)] == [8, 8, 8, 8]
    with pytest.raises(ScheduleError, match="in flight"):
        check_schedule(
            build_schedule("gpipe", p, m), m, max_in_flight=[in_flight_bound("1f1b", p, m, 1, r) for r in range(p)]
        )


def test_steady_state_groups_send_next_with_recv_prev_and_recv_next():
    """1F1B p=4: the middle rank's steady state posts send-next with recv-next after a forward, and
    recv-prev with send-prev after a backward (Megatron's send_forward_recv_backward and
    send_backward_recv_forward), each group once, in send-next, recv-prev, send-prev, recv-next order."""
    rank1 = build_programs("1f1b", 4, 8)[1]
    groups = [[(o.action.kind, o.action.microbatch) for o in s.ops] for s in rank1 if isinstance(s, P2PGroup)]
    assert [("send_forward", 3), ("recv_backward", 1)] in groups
    assert [("recv_forward", 4), ("send_backward", 1)] in groups


def test_interleaved_rank_order_takes_microbatch_groups_through_chunks():
    rank0 = [(a.microbatch, a.chunk) for a in build_schedule("interleaved-1f1b", 2, 4, 2)[0] if a.kind == "forward"]
    assert rank0 == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def _with_io(order, r, p):
    """A 2-stage rank's actions from its compute order (receives before, sends after)."""
    acts = []
    for kind, mb in order:
        if kind == "forward":
            acts += (
                ([Action("recv_forward", mb)] if r else [])
                + [Action("forward", mb)]
                + ([Action("send_forward", mb)] if r < p - 1 else [])
            )
        else:
            acts += (
                ([Action("recv_backward", mb)] if r < p - 1 else [])
                + [Action("backward", mb)]
                + ([Action("send_backward", mb)] if r else [])
            )
    return acts


def test_checker_finds_deadlock_and_bad_order():
    # rank 1 runs forward 1 before forward 0, rank 0 needs backward 0 before forward 1: a cycle
    deadlock = [
        _with_io([("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)], 0, 2),
        _with_io([("forward", 1), ("forward", 0), ("backward", 0), ("backward", 1)], 1, 2),
    ]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(deadlock, 2)
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
    with pytest.raises(ValueError, match="the zb-h2 schedule runs one model chunk per rank"):
        build_schedule("zb-h2", 2, 4, 2)
    with pytest.raises(ValueError, match="the zb-v schedule runs two model chunks per rank in a V; virtual_stages=1"):
        build_schedule("zb-v", 2, 4, 1)
    with pytest.raises(ValueError, match="dualpipev needs num_microbatches >= 2 \\* pp: pp=4, num_microbatches=7"):
        build_schedule("dualpipev", 4, 7, 2)


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
    with pytest.raises(
        ValueError, match=r"microbatch 1 has tokens \(2, 7\).*expected \[micro_batch_size, seq_length\] = \[2, 8\]"
    ):
        run_schedule(
            actions,
            torch.nn.Identity(),
            [good, short],
            pp=AxisGroup.single("pp"),
            hidden_shape=(2, 8, 4),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )


# ---- NCCL's point-to-point rules (layout/pipeline/nccl_model.py) ----

NCCL_CASES = [
    (kind, p, m, v)
    for kind in ("gpipe", "1f1b", "interleaved-1f1b", "forward-only")
    for p in (2, 3, 4, 8)
    for m in (1, 2, 3, 4, 5, 8, 12, 16, 24, 32)
    for v in (1, 2, 3, 4)
    if (v == 1 or kind in ("interleaved-1f1b", "forward-only"))
    and (kind != "interleaved-1f1b" or m % p == 0)
    and (kind != "forward-only" or v == 1 or m % p == 0)
] + [
    (kind, p, m, 2 if placement_of(kind) == "v" else 1)
    for kind in ("zb-h1", "zb-h2", "zb-v", "dualpipev", "auto")
    for p in range(2, 9)
    for m in (1, 2, 3, 4, 5, 8, 12, 15, 16, 24, 32)
    if kind != "dualpipev" or m >= 2 * p
]


def test_every_program_is_deadlock_free_under_nccl_rules():
    """Every kind, p in 2-8 (every p for the zero-bubble kinds), m up to 32, v up to 4 (the V kinds:
    traffic both ways between the same neighbours, and the hand-over at the turn): the runtime's
    groups complete under the NCCL model, and groups of one rank are in increasing schedule time with
    each send and its receive at the same time (the property the proof in program.py rests on)."""
    from ptdp.layout.pipeline.nccl_model import simulate_nccl

    for kind, p, m, v in NCCL_CASES:
        programs = build_programs(kind, p, m, v)
        simulate_nccl(programs)
        times = {}
        for r, program in enumerate(programs):
            groups = [s for s in program if isinstance(s, P2PGroup)]
            assert [g.time for g in groups] == sorted({g.time for g in groups}), (kind, p, m, v, r)
            for g in groups:
                assert g.communicator == "pp"
                for o in g.ops:
                    times.setdefault(o.tag, []).append((o.op, g.time))
        for tag, ends in times.items():
            assert sorted(ends) == [("recv", ends[0][1]), ("send", ends[0][1])], (kind, p, m, v, tag, ends)


def _grouped_like_the_action_list(kind, p, m, v):
    """The grouping ptdp used before: each run of consecutive transfers of a rank's actions posted
    as one group (what gloo tolerates and NCCL does not)."""
    from ptdp.layout.pipeline.program import P2POp, tag
    from ptdp.layout.pipeline.schedule import COMPUTE, peer

    programs = []
    for r, acts in enumerate(build_schedule(kind, p, m, v)):
        program, run = [], []
        for a in acts + [None]:
            if a is not None and a.kind not in COMPUTE:
                run.append(P2POp(a.kind[:4], peer(a, r, p), tag(a, r, p), a))
                continue
            if run:
                program.append(P2PGroup("pp", tuple(run), 0))
                run = []
            if a is not None:
                program.append(a)
        programs.append(program)
    return programs


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (8, 3)])
def test_nccl_model_finds_the_interleaved_deadlock_of_consecutive_grouping(p, v):
    """The model is strict enough to catch the real hang: interleaved 1F1B with m > p grouped as runs
    of consecutive transfers deadlocks under NCCL's rules, but not under gloo's; with m == p it runs."""
    from ptdp.layout.pipeline.nccl_model import simulate_nccl
    from ptdp.layout.pipeline.verify import check_programs

    with pytest.raises(ScheduleError, match="deadlock under NCCL"):
        simulate_nccl(_grouped_like_the_action_list("interleaved-1f1b", p, 2 * p, v))
    simulate_nccl(_grouped_like_the_action_list("interleaved-1f1b", p, p, v))
    check_programs(build_programs("interleaved-1f1b", p, 2 * p, v), virtual_stages=v)


def test_nccl_model_checks_order_tags_and_partners():
    from ptdp.layout.pipeline.nccl_model import Op, simulate_nccl

    group = lambda *ops: P2PGroup("pp", tuple(ops), 0)  # noqa: E731
    compute = Action("forward", 0)
    # two sends from 0 to 1, received in the other order: NCCL would swap the buffers
    swapped = [[group(Op("send", 1, "a"), Op("send", 1, "b"))], [group(Op("recv", 0, "b"), Op("recv", 0, "a"))]]
    with pytest.raises(ScheduleError, match="send #0 from rank 0 to rank 1 carries a but rank 1's receive #0"):
        simulate_nccl(swapped)
    with pytest.raises(ScheduleError, match="sends 1 messages to rank 1, which receives 0"):
        simulate_nccl([[group(Op("send", 1, "a"))], [compute]])
    with pytest.raises(ScheduleError, match="never sends"):
        simulate_nccl([[compute], [group(Op("recv", 0, "a"))]])
    # a rendezvous cycle: each rank sends first, in its own group, then receives
    crossed = [
        [group(Op("send", 1, "x")), group(Op("recv", 1, "y"))],
        [group(Op("send", 0, "y")), group(Op("recv", 0, "x"))],
    ]
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: send x waits for rank 1's step 1 \(rank 1 is at step 0\)"):
        simulate_nccl(crossed)
    # the same transfers in one group each: both start together and complete
    assert (
        simulate_nccl(
            [[group(Op("send", 1, "x"), Op("recv", 1, "y"))], [group(Op("send", 0, "y"), Op("recv", 0, "x"))]]
        )
        >= 1
    )
