"""Run a function in N gloo worker processes started from pytest, with a hard timeout: in new processes
(:func:`run_workers`) or on the workers kept for the session (:func:`run_in_pool`). Both fork their
workers from one fork server that has imported torch and ptdp (:func:`worker_context`)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import budget

PG_TIMEOUT = datetime.timedelta(seconds=60)

#: What the fork server imports once: every worker forked from it starts with them imported,
#: instead of importing torch and ptdp again (about 2 s of CPU per worker on the 2-core VM), and
#: what many jobs import later (torch._dynamo with torch.utils.checkpoint or --compile, 1.7 s;
#: torch.distributed.checkpoint, 0.9 s).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "ptdp.engine.step",
    "ptdp.run.checkpoint.io",
    "ptdp.run.planner_report",
]


def worker_context():
    """The ``forkserver`` multiprocessing context with :data:`PRELOAD`: each worker is a new
    process forked from a server that has only imported those modules (it never runs a job, holds
    no process group and starts no thread pool), so it starts as a spawned one would, without
    paying for the imports; the server starts on first use and exits with pytest."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server of :func:`worker_context` now and wait until it has imported
    :data:`PRELOAD` (the first worker's start waits for that otherwise)."""
    proc = worker_context().Process(target=int)  # int() returns at once
    proc.start()
    proc.join()


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
    """Start ``world_size`` new processes (forked from the fork server, :func:`worker_context`)
    running ``fn(rank, world_size, *args)`` on a gloo world.

    Returns each rank's return value. Fails (and kills the workers) after ``timeout`` seconds
    (default: what is left of the test's budget, :mod:`budget`; always ending before the test's
    own timeout); a worker's exception is re-raised here.
    """
    worker_context()  # the fork server's preloads, before it starts
    return spawn_and_collect(_entry, fn, world_size, args, budget.seconds(timeout), "workers", "forkserver")


def spawn_and_collect(
    entry: Callable, fn: Callable, world_size: int, args: tuple, timeout: float, what: str, start_method="spawn"
) -> list[Any]:
    """Start ``entry(rank, fn, world_size, tmp, args)`` on ``world_size`` new processes
    (``start_method``; each saves its result to ``tmp/result_<rank>.pt``); their results, or
    TimeoutError naming ``what`` after ``timeout`` seconds (the workers are killed either way)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            entry, args=(fn, world_size, tmp, args), nprocs=world_size, join=False, start_method=start_method
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]


# ---- workers kept for the session -----------------------------------------------------------------
#
# Starting a gloo world costs time per worker on a 2-core machine (a new process, its rendezvous; with
# a fresh interpreter also 2-4 s of importing torch and ptdp, which the fork server saves), more than
# most multi-process tests take to train. Tests whose
# jobs need no fresh processes share one world per size through :func:`run_in_pool`: its workers
# join the gloo world once and then run one job after another, each job building the process groups
# of its own layout (``ParallelGroups.build``), which are destroyed when it ends. A job that raises
# or outlives its timeout ends that world (every worker killed) and the next job starts a new one.
# :func:`run_workers` stays the way to get new processes (restarts, resuming in new processes, hung
# or stalled workers).


def _pool_entry(rank: int, world_size: int, store: str, conn) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    try:
        while (job := conn.recv()) is not None:
            fn, args, out = job
            before = set(_process_groups())
            try:
                torch.save(fn(rank, world_size, *args), os.path.join(out, f"result_{rank}.pt"))
                conn.send(None)
            except BaseException:
                conn.send(traceback.format_exc())
                return
            finally:
                for group in set(_process_groups()) - before:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()


def _process_groups() -> list:
    """This process's gloo groups (the default one included), or none if torch hides them."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


class WorkerPool:
    """``world_size`` gloo workers that run jobs ``fn(rank, world_size, *args)`` one after another."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"ptdp-tests-world{world_size}-")
        ctx = worker_context()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_pool_entry,
                args=(rank, world_size, os.path.join(self.tmp, "store"), there),
                daemon=True,
                name=f"ptdp-tests-world{world_size}-rank{rank}",
            )
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        out = tempfile.mkdtemp(dir=self.tmp)
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            conn.send((fn, args, out))
        waiting = dict(zip(self.conns, range(self.world_size)))
        ended = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            ready = mp_connection.wait([*waiting, *ended], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s")
            for item in ready:
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        error = item.recv()
                    except EOFError:  # it died without a word (killed)
                        self._exited(rank)
                    if error is not None:
                        raise RuntimeError(f"worker rank {rank} of {self.world_size} raised:\n{error}")
                elif item in ended and not any(waiting.get(c) == ended[item] for c in ready):
                    self._exited(ended[item])
        results = [torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in range(self.world_size)]
        shutil.rmtree(out, ignore_errors=True)
        return results

    def _exited(self, rank: int) -> None:
        self.procs[rank].join(timeout=5)
        raise RuntimeError(f"worker rank {rank} of {self.world_size} exited with code {self.procs[rank].exitcode}")

    def close(self) -> None:
        """Kill the workers and remove their folder."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: dict[int, WorkerPool] = {}


def run_in_pool(fn: Callable, world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Like :func:`run_workers`, on the session's workers of this world size (started on first
    use): each rank's return value; a worker's error is raised here. On an error or a timeout
    (default: what is left of the test's budget) the workers are killed and the next call starts
    new ones."""
    timeout = budget.seconds(timeout)
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        del _POOLS[world_size]
        pool.close()
        raise


@atexit.register
def close_pools() -> None:
    """End the workers of every pool (killed: they hold nothing that needs a clean exit, and their
    folder is removed)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
