"""FP8 runs of a tiny float64 GPT (emulated FP8 GEMMs, float64 compute) at a (tp, cp, pp, dp)
layout, for each recipe, against one process: every layout of one world size in one job."""

from __future__ import annotations

import functools

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import tiny_config, train_and_collect
from ptdp.config.fp8 import FP8Config
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

#: (tp, cp, pp, dp, sequence parallel) by world size
LAYOUTS = {2: [(2, 1, 1, 1, True), (1, 2, 1, 1, False)], 4: [(1, 1, 2, 2, False)], 8: [(2, 1, 2, 2, False)]}
#: each recipe with a format and options that differ from the defaults somewhere
RECIPES = {
    "tensorwise": FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise"),
    "delayed": FP8Config(
        fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2, fp8_amax_compute_algo="max"
    ),
    "rowwise": FP8Config(fp8_format="e4m3", fp8_recipe="rowwise", fp8_margin=1),
    "blockwise": FP8Config(fp8_format="e4m3", fp8_recipe="blockwise"),
}


def fp8_config(recipe: str | None, tp: int, cp: int, pp: int, dp: int, sp: bool = False) -> Config:
    """The tiny float64 GPT (:func:`helpers.layout_cases.tiny_config`: 4 layers, h 32, so blockwise
    tiles of 128 are cut by every shard; b 2, B 8, clipping active) with s 16 at this layout;
    ``recipe`` None: no FP8."""
    parallel = {"context_parallel_size": cp, "sequence_parallel": sp}
    fp8 = RECIPES[recipe] if recipe is not None else None
    return tiny_config(tp, pp, dp, "float64", parallel_overrides=parallel, fp8=fp8, seq_length=16)


def histories(stage) -> dict[str, dict[str, list[float]]]:
    """``{"history": ...}``: delayed scaling's amax history of every linear layer of this rank, by
    global module name."""
    return {
        "history": {
            name: module.fp8.delayed.history.flatten().tolist()
            for name, module in stage.model.named_modules()
            if getattr(module, "fp8", None) is not None and module.fp8.delayed is not None
        }
    }


def fp8_worker(rank: int, world: int) -> dict:
    """``{layout: {recipe: result}}`` of every layout of this world size."""
    out = {}
    for tp, cp, pp, dp, sp in LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
        runs = {}
        for recipe in RECIPES:
            cfg = fp8_config(recipe, tp, cp, pp, dp, sp)
            runs[recipe] = train_and_collect(
                cfg, groups, record_comm_step=0, collect=histories if recipe == "delayed" else None
            )
        out[(tp, cp, pp, dp, sp)] = runs
    return out


@functools.cache
def world_results(world: int) -> list[dict]:
    """Every rank's results of the layouts of ``world`` (one job on the session's workers; cached)."""
    return run_in_pool(fp8_worker, world)


@functools.cache
def reference(recipe: str | None) -> dict:
    """The single-process run of ``recipe`` (None: without FP8)."""
    cfg, groups = fp8_config(recipe, 1, 1, 1, 1), ParallelGroups.single_process()
    return train_and_collect(cfg, groups, collect=histories if recipe == "delayed" else None)
