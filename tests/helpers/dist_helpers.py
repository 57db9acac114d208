"""Run a function in N gloo worker processes spawned from pytest, with a hard timeout."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import budget


PG_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, fn: Callable, world_size: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size, timeout=PG_TIMEOUT
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` on a gloo world.

    Returns each rank's return value. Fails (and kills the workers) after ``timeout`` seconds
    (default: what is left of the test's budget, :mod:`budget`; always ending before the test's
    own timeout); a worker's exception is re-raised here.
    """
    timeout = budget.seconds(timeout)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world_size, tmp, args), nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not finish within {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
