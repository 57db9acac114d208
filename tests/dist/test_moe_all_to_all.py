"""The expert-parallel exchange on gloo: split counts, then rows with uneven and empty splits, and an
autograd backward that sends the gradients home with the splits swapped; counted on axis ``ep``."""

from __future__ import annotations

import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.moe.dispatch import exchange, exchange_counts
from ptdp.layout.grid import ParallelLayout

# rows rank i sends rank j; rank 1 sends and receives nothing, rank 2 keeps rows for itself
SPLITS = [[2, 0, 1], [0, 0, 0], [3, 0, 2]]


def _rows(src: int, n: int) -> torch.Tensor:
    return (src * 100 + torch.arange(n, dtype=torch.float64)).unsqueeze(1).expand(n, 3) + torch.tensor([0.0, 0.1, 0.2])


def exchange_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(dp=world), PG_TIMEOUT)
    ep = AxisGroup("ep", groups.dp.ranks, groups.dp.rank, groups.dp.group, groups.stats)
    sends = SPLITS[rank]
    x = _rows(rank, sum(sends)).clone().requires_grad_()
    received = exchange_counts(torch.tensor(sends), ep)
    out = exchange(x, ep, sends, received, tag="tokens")
    (out * (rank + 1.0)).sum().backward()
    return {
        "received": received,
        "out": out.detach(),
        "grad": x.grad,
        "comm": groups.stats.as_dict(),
    }


def test_uneven_and_empty_splits_go_there_and_back():
    results = run_in_pool(exchange_worker, 3)
    for r, res in enumerate(results):
        column = [SPLITS[j][r] for j in range(3)]
        assert res["received"] == column
        want = [_rows(j, sum(SPLITS[j]))[sum(SPLITS[j][:r]) : sum(SPLITS[j][: r + 1])] for j in range(3)]
        torch.testing.assert_close(res["out"], torch.cat(want), rtol=0, atol=0)
        dest = torch.cat([torch.full((n, 3), j + 1.0, dtype=torch.float64) for j, n in enumerate(SPLITS[r])])
        torch.testing.assert_close(res["grad"], dest, rtol=0, atol=0)
        sent = sum(SPLITS[r])
        assert res["comm"]["ep/all_to_all/tokens"] == {"calls": 1, "numel": 3 * sent, "bytes": 24 * sent}
        assert res["comm"]["ep/all_to_all/tokens_grad"]["numel"] == 3 * sum(res["received"])
        assert res["comm"]["ep/all_to_all/counts"]["numel"] == 3
