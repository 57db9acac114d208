"""The GPU check's ``fp8`` stage: the timed GPT trained without FP8, then with its layers' GEMMs in
FP8 under the tensorwise recipe, then the rowwise one, then blockwise, the same steps on the same data.

The model is the eager row's (``gpu_models.FULL``: the 1.3B GPT; ``--quick`` the tiny one) with
bfloat16 parameters (the stage's default dtype on the CPU too), tp = pp = dp = 1. Each run builds
ptdp's stage with the same weights drawn on the device (``gpu_models.device_stage``, one seed) and
trains ``warmup + steps`` steps on one fixed batch at a constant learning rate of :data:`LR` (the
loss falls, so the runs are compared where they learn); the FP8 runs use ``--fp8-format hybrid``
(e4m3 inputs and weights, e5m2 output gradients) for QKV, the attention projection, fc1 and fc2.
Per run: tokens/s from the median step after the warm-up (wall clock; each step's loss is read, so
it has ended on the device), MFU against the peak of the stage's dtype (bf16's for every run: the
same model FLOPs over the same peak, so the MFUs compare as the tokens/s do), peak memory, and the
loss difference against the run without FP8 at every step both ran: ``last_loss_diff`` (FP8 minus
baseline after the last compared step), its ``last_loss_rel_diff`` and the largest relative
difference. On CUDA each FP8 run also records which of its GEMMs (forward, dgrad, wgrad) run
``torch._scaled_mm`` for the recipe's scales and dtypes, and which are emulated (a note: such a
run's speed is not FP8's); on a CPU every FP8 GEMM is emulated.

Each run is written to the report as it goes and printed as one JSON line when it ends. A loss
that is not finite or does not fall fails the stage; the loss difference is reported, not judged.
A run starts only when its build and first step, as long as the previous run's, fit in the budget.
A run that raises fails the stage and the next one runs (without the baseline's losses, no comparison).
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from gpu_loss import compare_losses
from gpu_models import device_stage, flops_per_token, free_memory, speed_config, train_one_batch
from gpu_report import NOT_ON_CPU, Budget, StageReport

from ptdp.config.fp8 import FP8Config
from ptdp.config.schema import Config
from ptdp.engine.fp8 import FP8Recipe, has_scaled_mm_kernel, quantize_current

RECIPES = ("tensorwise", "rowwise", "blockwise")
"""The FP8 runs after the baseline, in order."""
FORMAT = "hybrid"
LR = 5e-4
RESERVE_S = 5.0
"""Seconds of the budget kept for the last synchronisation and the report."""
GEMMS = {"forward": ("input", "weight"), "dgrad": ("grad_output", "weight"), "wgrad": ("grad_output", "input")}
"""Each GEMM's two operands by role (``ptdp.engine.tensor_parallel.linear``)."""


def fp8_config(shape: dict, dtype: str, recipe: str | None) -> Config:
    """The stage's resolved config, with its GEMMs in FP8 under ``recipe`` (None: without FP8)."""
    fp8 = FP8Config(fp8_format=FORMAT, fp8_recipe=recipe) if recipe else None
    config = speed_config(shape, dtype, fp8=fp8)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, lr=LR, min_lr=LR))


def gemm_paths(recipe: str, dtype: str, device: torch.device) -> dict:
    """Per GEMM, whether ``recipe``'s operands run ``torch._scaled_mm`` here or are emulated
    (forward and dgrad give the activations' dtype, wgrad float32: the main gradient's)."""
    if device.type != "cuda":
        return {"status": NOT_ON_CPU}
    r = FP8Recipe(format=FORMAT, recipe=recipe)
    out: dict = {}
    for gemm, roles in GEMMS.items():  # 256 x 256 operands quantised with each role's scales
        (a, a_inv), (b, b_inv) = (
            quantize_current(torch.randn(256, 256, device=device), r.dtype(role), r.granularity(role)) for role in roles
        )
        out_dtype = torch.float32 if gemm == "wgrad" else getattr(torch, dtype)
        out[gemm] = "torch._scaled_mm" if has_scaled_mm_kernel(a, a_inv, b, b_inv, out_dtype) else "emulated"
    return out


def train_run(
    name: str, config: Config, shape: dict, device: torch.device, budget: Budget, report: StageReport, run: dict
) -> None:
    """Build the stage and train it into ``run`` (module docstring)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    stage = device_stage(config, device)
    run["build_s"] = time.perf_counter() - t0
    report.write()
    train_one_batch(stage, shape, run, budget=budget, report=report, what=f"fp8: {name}", reserve_s=RESERVE_S)


def run_fp8_stage(
    shape: dict, dtype: str, device: torch.device, budget: Budget, report: StageReport, peak: float | None
) -> None:
    """The baseline and each FP8 run into ``report["fp8"]["runs"]``, each printed as a JSON line when done."""
    names = [dtype, *(f"fp8 {r}" for r in RECIPES)]
    data: dict = {"baseline": dtype, "format": FORMAT, "lr": LR, "runs": []}
    report.update(fp8=data)
    per_token = flops_per_token(speed_config(shape, dtype))
    baseline: dict | None = None
    for name, recipe in zip(names, (None, *RECIPES)):
        runs = data["runs"]
        if runs and not budget.allows(RESERVE_S + runs[-1].get("build_s", 0.0) + runs[-1].get("first_step_s", 0.0)):
            report.out_of_budget(f"fp8: {name} not run")
            continue
        run: dict = {"name": name, "recipe": recipe}
        runs.append(run)
        if recipe is not None:
            run["gemm_path"] = gemm_paths(recipe, dtype, device)
            emulated = [g for g, path in run["gemm_path"].items() if path == "emulated"]
            if emulated:
                report.note(f"fp8: {name}: {', '.join(emulated)} emulated here (no torch._scaled_mm kernel)")
        error = None
        try:
            train_run(name, fp8_config(shape, dtype, recipe), shape, device, budget, report, run)
        except Exception as e:  # the next run may still work (e.g. another recipe's kernels)
            error = f"{type(e).__name__}: {e}"
        free_memory(device)  # this run's stage is gone with train_run's frame
        if error is not None:
            report.fail(f"fp8: {name}: {error}")
            continue
        tokens_per_s = run["tokens_per_s"]
        run["mfu"] = per_token * tokens_per_s / peak if tokens_per_s and peak else None
        if recipe is None:
            baseline = run
        elif baseline is not None:
            base_tps = baseline["tokens_per_s"]
            run["tokens_per_s_vs_baseline"] = tokens_per_s / base_tps if tokens_per_s and base_tps else None
            run.update(compare_losses(run["losses"], baseline["losses"]))
        report.write()
        print(json.dumps({"stage": "fp8", **run}), flush=True)
