"""The GPU check's loss check: a tiny model's step losses on the device against float64 on the CPU.

A 2-layer GPT (h = 64, s = 32, V = 300) trained :data:`LOSS_CHECK_STEPS` steps with ptdp's
``train_step`` in the checked precision on the device, and in float64 on the CPU from the same
initial weights (ptdp draws them on the CPU for every device) and data; on a GPU float64 on the
device too. A difference beyond what rounding explains (:func:`loss_bound`) is a failure.
:func:`compare_losses` compares two runs of a stage step by step.
"""

from __future__ import annotations

import dataclasses

import torch
from gpu_models import random_microbatches, speed_config

from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step

LOSS_BOUND = {"bfloat16": 1e-2, "float16": 1e-2, "tfloat32": 1e-2, "float32": 1e-5, "float64": 1e-9}
"""Largest relative loss difference against float64 expected from rounding alone, per precision
of the GEMMs' inputs: ``tfloat32`` is float32 whose matrix multiplications may run on TF32 tensor
cores (inputs rounded to 10 explicit mantissa bits, as float16's), so it has float16's bound."""
LOSS_CHECK_STEPS = 3
SHAPE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "vocab_size": 300,
    "micro_batch_size": 2,
    "num_microbatches": 2,
}


def loss_bound(dtype: str, device: torch.device) -> float:
    """:data:`LOSS_BOUND` of ``dtype`` on ``device``: float32 on CUDA takes TF32's, since ptdp lets
    its float32 GEMMs use TF32 there (``allow_tf32``: ``torch.get_float32_matmul_precision()`` not
    ``"highest"``); float32 on a CPU, or with ``"highest"``, keeps float32's."""
    if dtype == "float32" and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return LOSS_BOUND["tfloat32"]
    return LOSS_BOUND[dtype]


def _losses(device: torch.device, precision: str) -> list[float]:
    cfg = speed_config(SHAPE, precision)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e-3, min_lr=1e-3))
    stage = build_stage(cfg, ParallelGroups.single_process(), device)
    return [float(train_step(stage, random_microbatches(cfg, seed=1 + i), i).loss) for i in range(LOSS_CHECK_STEPS)]


def _rel(a: list[float], ref: list[float]) -> float:
    return max(abs(x - r) / abs(r) for x, r in zip(a, ref))


def loss_check(device: torch.device, dtype: str) -> dict:
    """The step losses on ``device`` in ``dtype`` (and float64 on a GPU) against float64 on the CPU,
    their largest relative difference (``max_rel_diff``) and its ``bound``."""
    reference = _losses(torch.device("cpu"), "float64")
    mine = _losses(device, dtype)  # after this build, the float32 matmul precision is ptdp's
    out = {
        "steps": LOSS_CHECK_STEPS,
        "model": SHAPE,
        "float64_cpu": reference,
        dtype: mine,
        "max_rel_diff": _rel(mine, reference),
        "bound": loss_bound(dtype, device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        on_device = _losses(device, "float64")
        out["float64_device"] = on_device
        out["max_rel_diff_float64_device_vs_cpu"] = _rel(on_device, reference)
    return out


def loss_failures(check: dict, dtype: str) -> list[str]:
    """The loss check's differences beyond rounding: ``dtype`` against float64 above the check's
    ``bound`` (:data:`LOSS_BOUND` of ``dtype`` when it has none), float64 on the device against the
    CPU above float64's."""
    out = []
    bound = check.get("bound", LOSS_BOUND[dtype])
    if check["max_rel_diff"] is not None and not check["max_rel_diff"] <= bound:
        out.append(
            f"loss check: {dtype} differs from float64 on the CPU by {check['max_rel_diff']:.2e} "
            f"(relative), more than rounding explains ({bound:.0e})"
        )
    on_device = check.get("max_rel_diff_float64_device_vs_cpu")
    if on_device is not None and not on_device <= LOSS_BOUND["float64"]:
        out.append(f"loss check: float64 on the device differs from the CPU by {on_device:.2e} (bound 1e-09)")
    return out


def compare_losses(losses: list[float], baseline: list[float]) -> dict:
    """``losses`` against ``baseline``'s at every step both ran: ``compared_steps``, ``loss_diff``
    (each minus the baseline), ``last_loss_diff``, its ``last_loss_rel_diff`` and the largest
    relative difference ``max_loss_rel_diff`` (None without a common step)."""
    n = min(len(losses), len(baseline))
    diff = [losses[i] - baseline[i] for i in range(n)]
    rel = [abs(d) / abs(b) for d, b in zip(diff, baseline)]
    return {
        "compared_steps": n,
        "loss_diff": diff,
        "last_loss_diff": diff[-1] if n else None,
        "last_loss_rel_diff": diff[-1] / abs(baseline[n - 1]) if n else None,
        "max_loss_rel_diff": max(rel) if n else None,
    }
