"""The experts' grid folded over the dense grid's ranks: coordinates, groups, the pipeline shared."""

from __future__ import annotations

import itertools

import pytest

from ptdp.layout.expert_grid import EXPERT_GROUPS, ExpertLayout
from ptdp.layout.grid import ParallelLayout


def test_the_documented_example():
    grid = ExpertLayout(ParallelLayout(tp=2, pp=2, dp=2), ep=2)
    assert grid.edp == 2
    assert grid.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.group_ranks("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.group_ranks("pp") == ParallelLayout(tp=2, pp=2, dp=2).group_ranks("pp")
    assert grid.local_experts(8, 1) == range(4, 8)


@pytest.mark.parametrize(
    ("tp", "cp", "dp", "pp", "ep", "etp"),
    [(1, 1, 4, 1, 4, 1), (2, 1, 4, 2, 2, 2), (2, 2, 2, 1, 4, 2), (1, 2, 3, 2, 3, 2), (4, 1, 1, 1, 1, 4)],
)
def test_groups_partition_each_stage_and_coordinates_round_trip(tp, cp, dp, pp, ep, etp):
    dense = ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp)
    grid = ExpertLayout(dense, ep=ep, etp=etp)
    assert grid.etp * grid.ep * grid.edp * dense.pp == dense.world_size
    for r in range(dense.world_size):
        c = grid.coords(r)
        assert grid.rank(etp_rank=c.etp_rank, ep_rank=c.ep_rank, edp_rank=c.edp_rank, pp_rank=c.pp_rank) == r
        assert c.pp_rank == dense.coords(r).pp_rank
    for axis in EXPERT_GROUPS:
        groups = grid.group_ranks(axis)
        assert sorted(itertools.chain(*groups)) == list(range(dense.world_size))
        for group in groups:
            assert len({grid.coords(r).pp_rank for r in group}) == 1 or axis == "pp"
            if axis in ("etp", "ep", "edp"):
                assert [getattr(grid.coords(r), f"{axis}_rank") for r in group] == list(range(len(group)))
    sizes = {"etp": etp, "ep": ep, "edp": grid.edp, "pp": pp, "ep_etp": ep * etp}
    assert {axis: len(grid.group_ranks(axis)[0]) for axis in EXPERT_GROUPS} == sizes


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="etp x ep = 1 x 3 does not divide"):
        ExpertLayout(ParallelLayout(dp=4), ep=3)
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        ExpertLayout(ParallelLayout(dp=4), ep=0)
    with pytest.raises(ValueError, match="unknown expert axis"):
        ExpertLayout(ParallelLayout(dp=4), ep=2).group_ranks("tp")
    with pytest.raises(ValueError, match="outside"):
        ExpertLayout(ParallelLayout(dp=4), ep=2).coords(4)
