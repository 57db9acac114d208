"""A worker that stops responding makes the job fail within the process-group timeout (plus a
small margin), with a message naming the rank, the phase, the iteration and the stalled rank."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helpers import run_workers
from ptdp.engine import activity
from ptdp.engine.comm import P2P, AxisGroup, CommStats, all_reduce, post

TIMEOUT_S = 3.0


def stalled_peer_worker(rank: int, world: int) -> tuple:
    """Rank 2 stops responding; rank 0 waits for a pipeline recv from it, rank 1 in a dp all-reduce.

    Rank 2 neither sends nor joins the all-reduce: it waits in a barrier of the world group (60 s
    timeout) that ranks 0 and 1 join only once their own waits have timed out and been diagnosed,
    so that it stays silent on both groups for as long as they need and no longer."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    groups = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 2], timeout=timeout)]
    if rank == 2:
        dist.barrier()
        return ("silent",)
    activity.start_step(rank, 4)
    stats = CommStats()
    try:
        if rank == 0:
            activity.set_phase(activity.PIPELINE)
            pp = AxisGroup("pp", (0, 2), 0, groups[0], stats, TIMEOUT_S)
            post([P2P("recv", torch.empty(3), peer=1)], pp)[0].wait()
        else:
            activity.set_phase(activity.GRAD_SYNC)
            all_reduce(torch.ones(3), AxisGroup("dp", (1, 2), 0, groups[1], stats, TIMEOUT_S))
    except activity.CollectiveError as e:
        result = (type(e).__name__, str(e), e.rank, e.phase, e.iteration)
    else:
        result = ("no error",)
    dist.barrier()
    return result


@pytest.mark.slow
def test_a_timed_out_collective_names_rank_phase_iteration_and_the_stalled_rank():
    results = run_workers(stalled_peer_worker, 3)
    assert results[2] == ("silent",)
    kind, message, rank, phase, iteration = results[0]
    assert (kind, rank, phase, iteration) == ("CollectiveTimeout", 0, activity.PIPELINE, 4)
    assert message.startswith(
        "rank 0 timed out after 0.05 min in pipeline send/recv at iteration 4: "
        "pp recv from rank 2 did not complete (rank 2 reported no timeout of its own"
    ), message
    kind, message, rank, phase, iteration = results[1]
    assert (kind, rank, phase, iteration) == ("CollectiveTimeout", 1, activity.GRAD_SYNC, 4)
    assert message.startswith(
        "rank 1 timed out after 0.05 min in gradient sync at iteration 4: "
        "dp all_reduce over ranks 1, 2 did not complete (rank 2 reported"
    ), message
