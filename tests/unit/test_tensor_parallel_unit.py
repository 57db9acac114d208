"""Tensor-parallel pieces in one process: sharding round trips, and the cross entropy's ignored and
out-of-range labels at tp = 1 (tp = 2 and 4: tests/dist/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.tp_cases import VOCAB, check_label_cases, inputs, label_cases
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.sharding import GlobalParam, shard, unshard


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(tp, groups):
    spec = GlobalParam((groups * 8, 5), tp_dim=0, tp_groups=groups)
    full = torch.arange(groups * 8 * 5, dtype=torch.float64).view(groups * 8, 5)
    shards = [shard(full, spec, r, tp) for r in range(tp)]
    assert all(s.shape == spec.local_shape(tp) for s in shards)
    assert torch.equal(unshard(shards, spec), full)
    if groups == 3 and tp == 2:  # each rank keeps the same heads of q, k and v
        assert shards[0][:, 0].tolist() == [0, 5, 10, 15, 40, 45, 50, 55, 80, 85, 90, 95]


def test_local_shape_rejects_indivisible_split():
    with pytest.raises(ValueError, match="not divisible"):
        GlobalParam((10, 4), tp_dim=0).local_shape(4)


@pytest.mark.parametrize("world", [1])  # tp = 2 and 4: tests/dist/test_tensor_parallel.py
def test_cross_entropy_ignores_label_minus_100_and_rejects_out_of_range_labels_on_every_path(world):
    """-100 gives loss 0 and no gradient at tp = 1 (``F.cross_entropy``) and tp > 1 (ranks 2 and 3
    of tp = 4 hold padding only) alike; any other label outside [0, V) raises the same
    ValueError on every path, before any collective."""
    results = [label_cases(ParallelGroups.single_process().tp, inputs(), 0, VOCAB)]
    check_label_cases(results)
