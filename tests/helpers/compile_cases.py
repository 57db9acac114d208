"""The tiny model trained eagerly and with ``--compile``, for the compile tests (unit: tp = 1;
dist: tp = 2)."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.utils import counters

from helpers.dist_helpers import PG_TIMEOUT
from helpers.layout_cases import tiny_config, train_and_collect
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

#: float32 tolerance between compiled and eager runs (different kernels, same arithmetic)
TOL = dict(rtol=1e-5, atol=1e-6)


def eager_and_compiled(tp: int, groups: ParallelGroups, **model) -> dict:
    """Three steps of the float32 tiny model eagerly and compiled (inductor), from the same
    weights and data: losses, parameters and the first step's communication of each, and the
    number of graphs dynamo compiled."""
    cfg = tiny_config(tp, 1, 1, "float32", **model)
    eager = train_and_collect(cfg, groups, record_comm_step=0)
    torch._dynamo.reset()
    counters.clear()
    compiled = train_and_collect(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=True)), groups, record_comm_step=0
    )
    return {"eager": eager, "compiled": compiled, "graphs": counters["stats"]["unique_graphs"]}


def compile_worker(rank: int, world: int) -> dict:
    return eager_and_compiled(world, ParallelGroups.build(ParallelLayout(tp=world), PG_TIMEOUT))


def assert_trains_like_eager(res: dict) -> None:
    """Same losses and parameters within float32 tolerance, the same communication."""
    eager, compiled = res["eager"], res["compiled"]
    assert res["graphs"] >= 1, "nothing was compiled"
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(compiled["norms"]), torch.tensor(eager["norms"]), **TOL)
    assert compiled["params"].keys() == eager["params"].keys()
    for name, (value, _, _) in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name][0], value, **TOL, msg=lambda m: f"{name}: {m}")
    assert compiled["comm"] == eager["comm"]
