"""Pure rank math of the tp x pp x dp grid (no processes)."""

from __future__ import annotations

import itertools

import pytest

from ptdp.spec.layout import ParallelLayout


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
