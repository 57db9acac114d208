"""Pure rank math of the tp x cp x dp x pp grid (no processes)."""

from __future__ import annotations

import itertools

import pytest

from ptdp.layout.grid import Coords, ParallelLayout


def test_worked_example_world8():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.embedding_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("tp,pp,dp", list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 5])))
def test_groups_partition_world_and_coords_invert(tp, pp, dp):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    world = tp * pp * dp
    for r in range(world):
        c = layout.coords(r)
        assert layout.rank(tp_rank=c.tp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank) == r
        assert r == c.tp_rank + tp * c.dp_rank + tp * dp * c.pp_rank
    for axis, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = layout.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
        for g in groups:
            coords = [layout.coords(r) for r in g]
            assert [getattr(c, f"{axis}_rank") for c in coords] == list(range(size))
            others = {tuple(getattr(c, f"{a}_rank") for a in ("tp", "dp", "pp") if a != axis) for c in coords}
            assert len(others) == 1
    assert all(g == list(range(g[0], g[0] + tp)) for g in layout.group_ranks("tp")), "TP groups are consecutive"
    emb = layout.embedding_group_ranks()
    if pp == 1:
        assert emb == []
    else:
        for g in emb:
            assert [layout.coords(r).pp_rank for r in g] == [0, pp - 1]


def test_invalid_sizes_and_ranks():
    with pytest.raises(ValueError, match="tp size must be a positive integer"):
        ParallelLayout(tp=0)
    layout = ParallelLayout(tp=2, pp=1, dp=1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        layout.coords(2)
    with pytest.raises(ValueError, match="unknown axis"):
        layout.group_ranks("sp")


def test_worked_example_tp2_cp2_dp2_pp2():
    layout = ParallelLayout(tp=2, pp=2, dp=2, cp=2)
    assert layout.world_size == 16
    assert [layout.coords(r).cp_rank for r in range(16)] == [0, 0, 1, 1] * 4
    assert [layout.coords(r).dp_rank for r in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert layout.coords(13) == Coords(tp_rank=1, dp_rank=1, pp_rank=1, cp_rank=0)
    assert layout.rank(tp_rank=0, cp_rank=1, dp_rank=1, pp_rank=1) == 14
    assert layout.group_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.group_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert layout.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.embedding_group_ranks() == [[i, i + 8] for i in range(8)]


@pytest.mark.parametrize("tp,cp,dp,pp", list(itertools.product([1, 2, 3], [1, 2, 3], [1, 2], [1, 3])))
def test_cp_groups_partition_world_and_coords_invert(tp, cp, dp, pp):
    layout = ParallelLayout(tp, pp, dp, cp)
    world = tp * cp * dp * pp
    assert layout.world_size == world
    for r in range(world):
        c = layout.coords(r)
        assert layout.rank(tp_rank=c.tp_rank, cp_rank=c.cp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank) == r
        assert r == c.tp_rank + tp * (c.cp_rank + cp * (c.dp_rank + dp * c.pp_rank))
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp}
    for axis, size in sizes.items():
        groups = layout.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
        varying = ("cp", "dp") if axis == "dp_cp" else (axis,)
        for g in groups:
            coords = [layout.coords(r) for r in g]
            fixed = {
                tuple(getattr(c, f"{a}_rank") for a in ("tp", "cp", "dp", "pp") if a not in varying) for c in coords
            }
            assert len(fixed) == 1
            if axis == "dp_cp":
                assert [c.cp_rank + cp * c.dp_rank for c in coords] == list(range(size))
            else:
                assert [getattr(c, f"{axis}_rank") for c in coords] == list(range(size))
    for g in layout.embedding_group_ranks():
        first, last = (layout.coords(r) for r in g)
        assert (first.pp_rank, last.pp_rank) == (0, pp - 1)
        assert (first.tp_rank, first.cp_rank, first.dp_rank) == (last.tp_rank, last.cp_rank, last.dp_rank)


def test_cp_one_is_the_three_axis_grid():
    for tp, pp, dp in itertools.product([1, 2, 4], [1, 2], [1, 3]):
        three, four = ParallelLayout(tp, pp, dp), ParallelLayout(tp, pp, dp, cp=1)
        assert three == four
        assert four.group_ranks("dp_cp") == four.group_ranks("dp")
        assert four.group_ranks("cp") == [[r] for r in range(tp * pp * dp)]


def test_invalid_cp():
    with pytest.raises(ValueError, match="cp size must be a positive integer, got 0"):
        ParallelLayout(2, 1, 1, 0)
    with pytest.raises(ValueError, match="cp_rank 2 outside"):
        ParallelLayout(1, 1, 1, 2).rank(tp_rank=0, dp_rank=0, pp_rank=0, cp_rank=2)
