"""The GPU check's ``zb`` stage: ptdp's zero-bubble runtime on one device (pp = 1), the timed GPT
trained the same steps on the same batch under ``1f1b``, ``zb-h1`` and ``zb-v``.

The model is the eager row's (``gpu_models.FULL``: the 1.3B GPT; ``--quick`` the tiny one), tp =
pp = dp = 1, with at least :data:`MICROBATCHES` microbatches. The 1f1b run's stage draws its
weights on the device (``gpu_models.device_stage``); the zero-bubble runs' stages get the same
values, copied by global parameter name. zb-h1 and zb-v split each backward into the input
gradient (B) and the weight gradient (W, deferred in closures and run later); zb-v holds two
chunks on the V placement, at pp = 1 chunk 0 is stage 0 and chunk 1 stage 1, the tied word
embedding one parameter of both. At pp = 1 each W follows its B (no bubble to fill), so the step
time against 1f1b is the cost of the split backward and its closures.

Each run trains ``warmup + steps`` steps at a constant learning rate of :data:`LR` and records its
losses, the median step after the warm-up (wall clock; each step's loss is read, so it has ended
on the device), tokens/s, its program's actions by kind and, on CUDA, peak memory. A zero-bubble
run's losses are compared with 1f1b's at every step both ran (``gpu_loss.compare_losses``); a
``max_loss_rel_diff`` above ``gpu_loss.loss_bound`` of the dtype fails the stage, as does a loss
that is not finite or does not fall. ``step_s_vs_1f1b`` (median step over 1f1b's) is reported,
not judged. Each run is written to the report as it goes and printed as one JSON line when it
ends; a run starts only when the previous run's build and first step still fit in the budget; a
run that raises fails the stage and the next one runs (without 1f1b's weights, no comparison).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from unittest import mock

import torch
from gpu_loss import compare_losses, loss_bound
from gpu_models import device_stage, free_memory, speed_config, train_one_batch
from gpu_report import Budget, StageReport

import ptdp.engine.stage as ptdp_stage
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import Stage, build_stage
from ptdp.layout.pipeline.program import build_programs

SCHEDULES = ("1f1b", "zb-h1", "zb-v")
"""The runs, in order; the first is the baseline."""
MICROBATCHES = 4
LR = 5e-4
RESERVE_S = 5.0
"""Seconds of the budget kept for the last synchronisation and the report."""


def zb_shape(shape: dict) -> dict:
    """``shape`` with at least :data:`MICROBATCHES` microbatches per step."""
    return dict(shape, num_microbatches=max(shape["num_microbatches"], MICROBATCHES))


def zb_config(shape: dict, dtype: str, schedule: str) -> Config:
    """The stage's resolved config under pipeline schedule ``schedule`` (tp = pp = dp = 1)."""
    config = speed_config(shape, dtype)
    config = dataclasses.replace(
        config,
        parallel=dataclasses.replace(config.parallel, pipeline_schedule=schedule),
        train=dataclasses.replace(config.train, lr=LR, min_lr=LR),
    )
    return resolve(config, 1)


def initial_values(stage: Stage) -> dict[str, torch.Tensor]:
    """A copy of each parameter of ``stage`` by its global name (a parameter shared by two chunks once)."""
    return {name: p.detach().clone() for chunk in stage.chunks for name, p in chunk.named_parameters()}


@contextlib.contextmanager
def _initial_values_from(values: dict[str, torch.Tensor]):
    """ptdp's ``build_stage`` with each parameter set to a copy of ``values[its global name]``;
    raises ``KeyError`` naming a parameter ``values`` lacks."""

    def copy(module, **_) -> None:
        for name, param in module.named_parameters():
            if name not in values:
                raise KeyError(f"no initial value for parameter {name!r} (the 1f1b stage has {len(values)})")
            param.data = values[name].clone()

    with mock.patch.object(ptdp_stage, "initialize_parameters", copy):
        yield


def build(config: Config, device: torch.device, values: dict[str, torch.Tensor] | None) -> Stage:
    """The stage of ``config`` on ``device``: weights drawn there (``values`` None) or copied from ``values``."""
    if values is None:
        return device_stage(config, device)
    with _initial_values_from(values):
        return build_stage(config, ParallelGroups.single_process(), device)


def program_actions(config: Config) -> dict[str, int]:
    """The actions of the stage's program (pp = 1, one rank) by kind."""
    m = config.train.global_batch_size // config.train.micro_batch_size
    (program,) = build_programs(config.parallel.schedule, 1, m, config.pipeline.virtual_stages)
    return dict(collections.Counter(action.kind for action in program))


def train_run(
    config: Config,
    shape: dict,
    device: torch.device,
    budget: Budget,
    report: StageReport,
    run: dict,
    values: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Build the stage and train it into ``run`` (module docstring); its initial values."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    stage = build(config, device, values)
    run["build_s"] = time.perf_counter() - t0
    chunks = stage.chunks
    run["virtual_stages"] = len(chunks)
    if len(chunks) == 2:
        first, last = chunks
        run["tied_embedding_shared"] = first.word_embeddings is last.word_embeddings
    start = initial_values(stage) if values is None else values
    report.write()
    what = f"zb: {config.parallel.schedule}"
    train_one_batch(stage, shape, run, budget=budget, report=report, what=what, reserve_s=RESERVE_S)
    return start


def run_zb_stage(shape: dict, dtype: str, device: torch.device, budget: Budget, report: StageReport) -> None:
    """Each schedule's run into ``report["zb"]["runs"]``, each printed as a JSON line when done."""
    bound = loss_bound(dtype, device)
    data: dict = {"baseline": SCHEDULES[0], "lr": LR, "loss_bound": bound, "runs": []}
    report.update(zb=data)
    values: dict[str, torch.Tensor] | None = None
    baseline: dict | None = None
    for schedule in SCHEDULES:
        runs = data["runs"]
        if runs and not budget.allows(RESERVE_S + runs[-1].get("build_s", 0.0) + runs[-1].get("first_step_s", 0.0)):
            report.out_of_budget(f"zb: {schedule} not run")
            continue
        run: dict = {"name": schedule}
        runs.append(run)
        error = None
        try:
            config = zb_config(shape, dtype, schedule)
            run["program"] = program_actions(config)
            start = train_run(config, shape, device, budget, report, run, values)
            if schedule == SCHEDULES[0]:
                values = start
        except Exception as e:  # the next schedule may still run
            error = f"{type(e).__name__}: {e}"
        free_memory(device)  # this run's stage is gone with train_run's frame
        if error is not None:
            report.fail(f"zb: {schedule}: {error}")
            continue
        if schedule == SCHEDULES[0]:
            baseline = run
        elif baseline is not None:
            base_s, mine = baseline["median_step_s"], run["median_step_s"]
            run["step_s_vs_1f1b"] = mine / base_s if mine and base_s else None
            run.update(compare_losses(run["losses"], baseline["losses"]))
            worst = run["max_loss_rel_diff"]
            if worst is not None and not worst <= bound:
                report.fail(
                    f"zb: {schedule}: losses differ from 1f1b's by {worst:.2e} (relative) over "
                    f"{run['compared_steps']} steps, more than {dtype} rounding explains ({bound:.0e})"
                )
        report.write()
        print(json.dumps({"stage": "zb", **run}), flush=True)
    del values
    free_memory(device)
