"""Run a function in N NCCL worker processes, one GPU each (``tests/gpu``), and train a model there.

Like :func:`helpers.dist_helpers.run_workers`, with backend ``nccl`` and worker ``r`` on ``cuda:r``
(one machine). Results are moved to the CPU before they leave the worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from helpers import budget
from helpers.dist_helpers import PG_TIMEOUT, spawn_and_collect
from helpers.layout_cases import rank_microbatches
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _entry(rank: int, fn: Callable, world_size: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=PG_TIMEOUT,
        device_id=device,
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(to_cpu(result), os.path.join(tmp, f"result_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_nccl_workers(fn: Callable, world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` on an NCCL world, rank
    r on ``cuda:r``; returns each rank's result. Fails, killing the workers, after ``timeout``
    seconds (default: what is left of the test's budget), so a deadlock fails the test."""
    return spawn_and_collect(_entry, fn, world_size, args, budget.seconds(timeout), "NCCL workers (a hang?)")


def train_on_device(
    cfg: Config, groups: ParallelGroups, device: torch.device, steps: int, *, first: int = 0, stage=None
) -> dict:
    """Train 0-based steps ``first .. first + steps - 1`` on ``device``; the losses, gradient norms,
    this rank's parameters (with their specs) and the p2p bytes of the last step per call.
    ``stage``: continue this one instead of building a new one."""
    stage = stage if stage is not None else build_stage(cfg, groups, device)
    pending = []
    for step in range(first, first + steps):
        groups.stats.reset()
        pending.append(train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step))
    stage.wait_for_params()
    results = [(float(r.loss), float(r.grad_norm)) for r in pending]
    pp = {k: v for k, v in groups.stats.as_dict().items() if k.startswith("pp/")}
    c = groups.coords
    return {
        "losses": [loss for loss, _ in results],
        "norms": [norm for _, norm in results],
        "params": {n: (p.detach().clone(), p.ptdp_global, False) for n, p in global_named_parameters(stage.model)},
        "coords": (c.tp_rank, c.dp_rank, c.pp_rank),
        "largest_p2p_bytes": max((v["bytes"] / v["calls"] for v in pp.values() if v["calls"]), default=0),
    }
