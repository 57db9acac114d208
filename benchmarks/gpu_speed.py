"""The GPU check's speed rows: ptdp's ``train_step`` against the plain PyTorch GPT, eager or compiled.

At tp = pp = dp = 1, a 1.3B-parameter GPT (24 layers, hidden 2048, 16 heads, sequence 2048,
GPT-2's 50,257-token vocabulary; bfloat16 on a GPU) as ptdp's stage against ``plain_gpt.py``'s
model of the same shape and weights (float32 parameters under bf16 ``torch.autocast``), steps
alternating between the two so noise hits both alike. ``compile``: ptdp's ``--compile`` against
``torch.compile`` of the plain model. Each model pads its own vocabulary (ptdp to a multiple of
128, the plain GPT to one of 64 as nanoGPT: both 50,304) and computes its loss on the real one;
MFU counts the real one.

Both models are built with their weights drawn on the device (``gpu_models.device_stage``).

MFU = (model FLOPs per token x tokens/s) / peak FLOP/s, with model FLOPs per token
``6 N + 12 l h s`` (Chowdhery et al. 2022, "PaLM", App. B: N the parameters but the position table,
12 l h s the attention scores and their weighted sum, forward and backward). The peak is the
planner's catalog entry (``ptdp.planner.inputs.hardware``) for ``torch.cuda.get_device_name()`` in the
checked precision (TF32 for float32 on CUDA); ``--peak-tflops`` overrides it; a CPU has none.

Timing: CUDA events around each step (read when done, no extra synchronisation), wall clock on a
CPU; the row is rewritten after every round of two steps, and timing stops when the next round
would not fit in the stage's budget.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import gpu_loss
import torch
from gpu_models import device_stage, flops_per_token, random_microbatches
from gpu_report import NOT_ON_CPU, Budget
from plain_gpt import copy_weights, plain_like, plain_optimizer, plain_step

from ptdp.config.schema import Config
from ptdp.engine.stage import Stage
from ptdp.engine.step import train_step
from ptdp.engine.tensor_parallel import wgrad
from ptdp.planner.inputs.hardware import CATALOG

TARGETS = {"mfu_compiled_at_least": 0.50, "ratio_vs_plain_at_most": 1.05}
PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
RESERVE_S = 5.0
"""Seconds of a stage's budget kept for the last synchronisation, freeing the models and the report."""


def catalog_key(device_name: str) -> str | None:
    """The planner's catalog key for a ``torch.cuda.get_device_name()``, or None when the catalog
    has no entry with that GPU's peak (e.g. H100 PCIe and NVL, whose clocks differ from the SXM part)."""
    name = device_name.lower()
    if "pcie" in name and "h100" in name or "nvl" in name:
        return None
    for marker, key in (("h200", "h200"), ("h100", "h100-sxm"), ("v100", "v100-32gb")):
        if marker in name:
            return key
    if "a100" in name:
        return "a100-40gb" if "40gb" in name else "a100-80gb"
    return None


def peak_flops(device: torch.device, dtype: str, override_tflops: float | None) -> tuple[float | None, str]:
    """Peak FLOP/s for ``dtype`` on ``device`` and where the figure comes from."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "no catalog peak for a CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    key = catalog_key(name)
    precision = PRECISION.get(dtype)
    if dtype == "float32":  # ptdp's allow_tf32 on CUDA
        precision = "tf32"
    if key is None or precision not in CATALOG[key].peak_flops:
        return None, f"the planner's catalog has no {precision or dtype} peak for {name!r} (give --peak-tflops)"
    return CATALOG[key].peak(precision), f"ptdp.planner.inputs.hardware {key} {precision}"


def wgrad_record(device: torch.device, dtype: str) -> dict:
    """Which weight-gradient GEMM this process's training ran (``wgrad.FUSED_GEMM``); the fused one
    exists on CUDA for 16-bit weights only."""
    out: dict = dataclasses.asdict(wgrad.FUSED_GEMM)
    if device.type != "cuda":
        out["status"] = NOT_ON_CPU
    elif dtype not in ("bfloat16", "float16"):
        out["status"] = f"not used: {dtype} weights have no float32 main gradient"
    elif out["fallback"] or out["error"]:
        out["status"] = "fell back"
    elif not wgrad.hooks_run_without_grad():
        out["status"] = "not used: this torch runs no post-accumulate hook without a gradient"
    else:
        out["status"] = "fused" if out["fused"] else "not called"
    return out


def _seconds_done(marks: list, cuda: bool) -> list[float]:
    """The step times of ``marks`` known so far: CUDA event pairs that have completed (a query,
    no synchronisation), or wall-clock seconds."""
    if not cuda:
        return list(marks)
    return [s.elapsed_time(e) / 1e3 for s, e in marks if e.query()]


@dataclasses.dataclass
class _Models:
    """The two models of a row, on the device, with what their steps need."""

    stage: Stage
    plain: torch.nn.Module
    runner: torch.nn.Module  # the plain model, or its torch.compile
    optimizer: torch.optim.Optimizer
    autocast: torch.dtype | None
    microbatches: list


def _build(config: Config, mode: str, device: torch.device) -> _Models:
    """ptdp's stage (weights drawn on the device) and the plain GPT with the same weights, and the
    microbatches on the device: the steps measure compute, not input copies."""
    dtype = config.model.params_dtype
    stage = device_stage(config, device)
    with torch.device(device):
        plain = plain_like(config)
    copy_weights(stage.model, plain, config.model.vocab_size)
    if dtype in ("float64", "float32"):
        plain.to(getattr(torch, dtype))
    return _Models(
        stage=stage,
        plain=plain,
        runner=torch.compile(plain) if mode == "compile" else plain,
        optimizer=plain_optimizer(plain, config.train, device),
        autocast=getattr(torch, dtype) if dtype in ("bfloat16", "float16") else None,
        microbatches=[(x.to(device), y.to(device)) for x, y in random_microbatches(config, seed=0)],
    )


def measure_mode(
    config: Config, mode: str, shape: dict, device: torch.device, budget: Budget, peak: float | None, publish
) -> dict:
    """One row: ptdp against the plain GPT, both eager or both compiled; MFU against ``peak`` FLOP/s
    (None: not given). ``publish(row)`` is called whenever the row has new results (the stage
    rewrites its report); ``stopped_by_budget`` says whether timing ended before
    ``shape["steps"]`` timed steps."""
    dtype = config.model.params_dtype
    cuda = device.type == "cuda"
    tokens = config.train.global_batch_size * config.model.seq_length
    per_token = flops_per_token(config)
    row: dict = {"mode": mode, "requested_steps": shape["steps"], "warmup": shape["warmup"], "timed_steps": 0}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    models = _build(config, mode, device)
    if cuda:
        torch.cuda.synchronize(device)
    row["build_s"] = time.perf_counter() - t0
    row["flop_params"] = models.plain.flop_params()
    row["vocab_rows"] = {
        "ptdp": models.stage.model.word_embeddings.weight.shape[0],
        "plain": models.plain.wte.weight.shape[0],
    }
    publish(row)
    clip = config.train.clip_grad

    def ptdp(i: int):  # the step's metrics stay on the device (no host synchronisation)
        return train_step(models.stage, models.microbatches, i)

    def plain_(i: int) -> torch.Tensor:
        m = models
        return plain_step(m.runner, m.optimizer, m.microbatches, clip, device=device, autocast_dtype=m.autocast)

    first: dict = {}
    row["first_step_s"], row["first_step_loss"] = {}, first
    for name, read in (("ptdp", lambda: ptdp(0).loss), ("plain", lambda: float(plain_(0)))):
        t = time.perf_counter()  # compile mode: each model compiles here
        first[name] = read()
        row["first_step_s"][name] = time.perf_counter() - t
        publish(row)
    bound = gpu_loss.loss_bound(dtype, device)
    if abs(first["ptdp"] - first["plain"]) > 10 * bound * abs(first["plain"]):
        raise RuntimeError(f"the models differ: first-step loss ptdp {first['ptdp']} vs plain {first['plain']}")

    marks: dict[str, list] = {"ptdp": [], "plain": []}
    warmup, timed = shape["warmup"], shape["steps"]
    last_round = None
    row["stopped_by_budget"] = False
    for i in range(warmup + timed):
        if last_round is not None and not budget.allows(1.5 * last_round + RESERVE_S):
            row["stopped_by_budget"] = True
            break
        t = time.perf_counter()
        for name, step in (("ptdp", ptdp), ("plain", plain_)):
            if i < warmup:
                step(i + 1)
            elif cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(i + 1)
                end.record()
                marks[name].append((start, end))
            else:
                s = time.perf_counter()
                step(i + 1)
                marks[name].append(time.perf_counter() - s)
        last_round = time.perf_counter() - t
        if i >= warmup:
            _set_times(row, {n: _seconds_done(m, cuda) for n, m in marks.items()}, tokens, per_token, peak)
            publish(row)
    if cuda:
        torch.cuda.synchronize(device)
    _set_times(row, {n: _seconds_done(m, cuda) for n, m in marks.items()}, tokens, per_token, peak)
    if cuda:
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    row["wgrad_fused_gemm"] = wgrad_record(device, dtype)
    publish(row)
    return row


def _set_times(row: dict, seconds: dict[str, list[float]], tokens: int, per_token: int, peak) -> None:
    """The row's medians, ratio, tokens/s and MFU from the step times known so far (None without any)."""
    n = min(len(v) for v in seconds.values())
    row["timed_steps"] = n
    med = {k: statistics.median(v[:n]) if n else None for k, v in seconds.items()}
    row["ptdp_step_s"], row["plain_step_s"] = med["ptdp"], med["plain"]
    row["ratio_vs_plain"] = med["ptdp"] / med["plain"] if n else None
    row["tokens_per_s"] = tokens / med["ptdp"] if n else None
    row["plain_tokens_per_s"] = tokens / med["plain"] if n else None
    row["mfu"] = per_token * row["tokens_per_s"] / peak if n and peak else None
