"""One command that checks ptdp on one GPU: speed against plain PyTorch, MFU, and the loss against float64.

    python benchmarks/gpu_check.py --output gpu_check.json                  # one GPU, about 8 minutes at most
    python benchmarks/gpu_check.py --device cpu --quick --output cpu.json   # a tiny model on the CPU, seconds

At tp = pp = dp = 1 it measures:

- speed: ptdp's ``train_step`` on a 1.3B-parameter GPT (24 layers, hidden 2048, 16 heads,
  sequence 2048, GPT-2's 50,257-token vocabulary; bfloat16 on a GPU) against the plain PyTorch GPT
  of ``plain_gpt.py`` with the same shape and weights (bf16 through ``torch.autocast``), steps
  alternating between the two so noise hits both alike. Modes: ``eager``, and ``compile`` (ptdp's
  ``--compile`` against ``torch.compile`` of the plain model) when this ptdp's schema has a
  ``--compile`` flag; without it the compiled row is left out and the report says so. Per mode:
  the median step time of each, ``ratio_vs_plain`` (ptdp / plain), ptdp's tokens/s and MFU, and
  the peak device memory (both models and their optimizers are resident).
- correctness: a tiny model trained 3 steps on the device in the checked precision against the same
  model in float64 on the CPU (``max_loss_rel_diff_vs_float64_cpu``: the largest relative
  difference of the step losses); on a GPU also float64 on the device against float64 on the CPU.

MFU = (model FLOPs per token x tokens/s) / peak FLOP/s, with model FLOPs per token
``6 N + 12 l h s`` (Chowdhery et al. 2022, "PaLM", App. B: N the parameters but the position table,
12 l h s the attention scores and their weighted sum, forward and backward; recomputation is not
counted). The peak is the planner's catalog entry (``ptdp.planner.hardware``) for
``torch.cuda.get_device_name()``, for the checked precision; ``--peak-tflops`` overrides it; on a
CPU without ``--peak-tflops`` MFU is not given (null).

Memory: both models and their optimizer states stay resident (ptdp 18 bytes per parameter in
bf16 with float32 main parameters, the plain GPT 16), about 45 GB for the 1.3B model before
activations: a GPU of 80 GB. On a smaller one, ``--num-layers 12`` halves it (the report says
which shape ran).

Timing: CUDA events around each step, read after one synchronisation at the end (GPU); wall clock
(CPU). Targets printed beside the measurements: MFU >= 50% compiled, ratio vs plain <= 1.05.
The JSON report holds ``device``, ``tokens_per_s``, ``mfu`` and ``ratio_vs_plain`` of the compiled
mode when it ran (else eager; ``headline_mode`` says which), ``max_loss_rel_diff_vs_float64_cpu``,
``rows`` (every mode), the model, the precision, the peak and the targets. The speed targets are
reported, not enforced; the exit code is 1 when a mode fails to run or a loss differs from float64
by more than rounding explains (``LOSS_BOUND``; 1e-9 for float64 on the device), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from plain_gpt import copy_weights, plain_like, plain_optimizer, plain_step, with_compile

from ptdp.engine.groups import ParallelGroups
from ptdp.engine.step import build_stage, train_step
from ptdp.planner.hardware import CATALOG
from ptdp.spec import Config, ModelConfig, ParallelConfig, TrainConfig, resolve

FULL = {
    "num_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "seq_length": 2048,
    "vocab_size": 50257,
    "micro_batch_size": 2,
    "num_microbatches": 4,
    "steps": 10,
    "warmup": 3,
}
QUICK = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 512,
    "micro_batch_size": 2,
    "num_microbatches": 2,
    "steps": 3,
    "warmup": 1,
}
TARGETS = {"mfu_compiled_at_least": 0.50, "ratio_vs_plain_at_most": 1.05}
LOSS_BOUND = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5, "float64": 1e-9}
"""Largest relative loss difference against float64 expected from rounding alone, per precision."""
PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
LOSS_CHECK_STEPS = 3


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
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    if key is None or precision not in CATALOG[key].peak_flops:
        return None, f"the planner's catalog has no {precision or dtype} peak for {name!r} (give --peak-tflops)"
    return CATALOG[key].peak(precision), f"ptdp.planner.hardware {key} {precision}"


def flop_params(config: Config) -> int:
    """N of ``6 N + 12 l h s``: every parameter of the model but the position table, with the tied
    word embedding counted once (for the logits GEMM) on the real vocabulary: per layer
    ``4 h^2 + 2 h f`` weights and ``9 h + f`` biases and norm parameters, the final norm ``2 h``."""
    m = config.model
    h, f = m.hidden_size, m.ffn
    return m.num_layers * (4 * h * h + 2 * h * f + 9 * h + f) + 2 * h + m.vocab_size * h


def speed_config(shape: dict, dtype: str) -> Config:
    """The resolved single-process config of the timed model (GPT defaults, no dropout)."""
    model = ModelConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        seq_length=shape["seq_length"],
        vocab_size=shape["vocab_size"],
        params_dtype=dtype,
    )
    b, m = shape["micro_batch_size"], shape["num_microbatches"]
    train = TrainConfig(
        micro_batch_size=b,
        global_batch_size=b * m,
        train_iters=10_000,
        lr_warmup_iters=0,
        lr=1e-4,
        min_lr=1e-4,
        eval_iters=0,
    )
    return resolve(Config(model=model, parallel=ParallelConfig(), train=train), 1)


def random_microbatches(config: Config, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` CPU microbatches ``(tokens [b, s], labels [b, s])`` of random tokens."""
    t, s = config.train, config.model.seq_length
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.model.vocab_size, (t.global_batch_size, s + 1), generator=gen)
    b = t.micro_batch_size
    return [(data[i : i + b, :-1], data[i : i + b, 1:]) for i in range(0, t.global_batch_size, b)]


def median_step_times(steps: dict, device: torch.device, timed: int, warmup: int) -> dict[str, float]:
    """Run the step functions alternately ``warmup + timed`` times; the median seconds of each."""
    cuda = device.type == "cuda"
    marks: dict[str, list] = {name: [] for name in steps}
    for i in range(warmup + timed):
        for name, step in steps.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(i)
                end.record()
                mark = (start, end)
            else:
                t0 = time.perf_counter()
                step(i)
                mark = time.perf_counter() - t0
            if i >= warmup:
                marks[name].append(mark)
    if cuda:
        torch.cuda.synchronize(device)
        return {n: statistics.median(s.elapsed_time(e) / 1e3 for s, e in v) for n, v in marks.items()}
    return {n: statistics.median(v) for n, v in marks.items()}


def measure_mode(config: Config, mode: str, shape: dict, device: torch.device) -> dict:
    """One row: ptdp against the plain GPT, both eager or both compiled."""
    dtype = config.model.params_dtype
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stage = build_stage(config, ParallelGroups.single_process(), device)
    with torch.device(device):
        plain = plain_like(config)
    copy_weights(stage.model, plain, config.model.vocab_size)
    if dtype in ("float64", "float32"):
        plain.to(getattr(torch, dtype))
    optimizer = plain_optimizer(plain, config.train, device)
    runner = torch.compile(plain) if mode == "compile" else plain
    autocast = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else None
    # on the device before timing, for both: the steps measure compute, not input copies
    mbs = [(x.to(device), y.to(device)) for x, y in random_microbatches(config, seed=0)]
    clip = config.train.clip_grad
    ptdp_loss = float(train_step(stage, mbs, 0).loss)
    plain_loss = float(plain_step(runner, optimizer, mbs, clip, device=device, autocast_dtype=autocast))
    if abs(ptdp_loss - plain_loss) > 10 * LOSS_BOUND[dtype] * abs(plain_loss):
        raise RuntimeError(f"the models differ: first-step loss ptdp {ptdp_loss} vs plain {plain_loss}")
    steps = {
        "ptdp": lambda i: train_step(stage, mbs, i + 1),
        "plain": lambda i: plain_step(runner, optimizer, mbs, clip, device=device, autocast_dtype=autocast),
    }
    med = median_step_times(steps, device, shape["steps"], shape["warmup"])
    tokens = config.train.global_batch_size * config.model.seq_length
    row = {
        "mode": mode,
        "ptdp_step_s": med["ptdp"],
        "plain_step_s": med["plain"],
        "ratio_vs_plain": med["ptdp"] / med["plain"],
        "tokens_per_s": tokens / med["ptdp"],
        "plain_tokens_per_s": tokens / med["plain"],
        "first_step_loss": {"ptdp": ptdp_loss, "plain": plain_loss},
        "flop_params": plain.flop_params(),
    }
    if device.type == "cuda":
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    stage = plain = runner = optimizer = steps = None  # freed before the next mode (the closures are done)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def loss_check(device: torch.device, dtype: str) -> dict:
    """A tiny model's step losses on ``device`` in ``dtype`` (and float64 on a GPU) against float64 on the CPU."""
    shape = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "vocab_size": 300,
        "micro_batch_size": 2,
        "num_microbatches": 2,
    }

    def losses(dev: torch.device, precision: str) -> list[float]:
        cfg = speed_config(shape, precision)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e-3, min_lr=1e-3))
        stage = build_stage(cfg, ParallelGroups.single_process(), dev)
        return [float(train_step(stage, random_microbatches(cfg, seed=1 + i), i).loss) for i in range(LOSS_CHECK_STEPS)]

    def rel(a: list[float], ref: list[float]) -> float:
        return max(abs(x - r) / abs(r) for x, r in zip(a, ref))

    reference = losses(torch.device("cpu"), "float64")
    mine = losses(device, dtype)
    out = {
        "steps": LOSS_CHECK_STEPS,
        "model": shape,
        "float64_cpu": reference,
        dtype: mine,
        "max_rel_diff": rel(mine, reference),
        "bound": LOSS_BOUND[dtype],
    }
    if device.type == "cuda":
        on_device = losses(device, "float64")
        out["float64_device"] = on_device
        out["max_rel_diff_float64_device_vs_cpu"] = rel(on_device, reference)
    return out


def loss_failures(check: dict, dtype: str) -> list[str]:
    """The loss check's differences beyond rounding: ``dtype`` against float64 above its
    :data:`LOSS_BOUND`, float64 on the device against the CPU above 1e-9."""
    out = []
    if check["max_rel_diff"] is not None and not check["max_rel_diff"] <= LOSS_BOUND[dtype]:
        out.append(
            f"loss check: {dtype} differs from float64 on the CPU by {check['max_rel_diff']:.2e} "
            f"(relative), more than rounding explains ({LOSS_BOUND[dtype]:.0e})"
        )
    on_device = check.get("max_rel_diff_float64_device_vs_cpu")
    if on_device is not None and not on_device <= LOSS_BOUND["float64"]:
        out.append(f"loss check: float64 on the device differs from the CPU by {on_device:.2e} (bound 1e-09)")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="a tiny model (2 layers, h=64, s=64), eager only")
    ap.add_argument("--output", metavar="FILE", help="write the JSON report here")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "float64"),
        help="precision of the timed models (default: bfloat16 on a GPU, float32 on a CPU)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("eager", "compile"),
        help="default: eager and compile (--quick: eager); compile needs ptdp's --compile",
    )
    ap.add_argument("--num-layers", type=int, help="layers of the timed model (default 24; --quick 2)")
    ap.add_argument("--micro-batch-size", type=int, help="samples per microbatch (default 2)")
    ap.add_argument("--steps", type=int, help="timed steps of each model (default 10; --quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; --quick 1)")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s for MFU instead of the catalog's")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is available here (use --device cpu --quick)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        ap.error(f"--device {args.device}: this machine shows {torch.cuda.device_count()} CUDA devices")
    for name, least in (("steps", 1), ("warmup", 0), ("num_layers", 1), ("micro_batch_size", 1), ("threads", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= {least}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        ap.error(f"--peak-tflops {args.peak_tflops} must be > 0")
    if args.output is not None:
        folder = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            ap.error(f"--output {args.output}: not a file in an existing writable folder")
    return args


def run_check(args: argparse.Namespace) -> dict:
    """Measure every mode and the loss check; the report (see the module docstring)."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = dict(QUICK if args.quick else FULL)
    overrides = ("steps", "warmup", "num_layers", "micro_batch_size")
    shape.update({k: getattr(args, k) for k in overrides if getattr(args, k) is not None})
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = speed_config(shape, dtype)
    compiled = with_compile(config)
    rows, notes, failures = [], [], []
    for mode in args.modes or (["eager"] if args.quick else ["eager", "compile"]):
        if mode == "compile" and compiled is None:
            notes.append("compile: not measured, this ptdp has no --compile option")
            continue
        try:  # one failed mode must not lose the others' results
            rows.append(measure_mode(compiled if mode == "compile" else config, mode, shape, device))
        except Exception as e:
            failures.append(f"{mode}: {type(e).__name__}: {e}")
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    m = config.model
    flops_per_token = 6 * flop_params(config) + 12 * m.num_layers * m.hidden_size * m.seq_length
    for row in rows:
        row["mfu"] = flops_per_token * row["tokens_per_s"] / peak if peak else None
    try:
        check = loss_check(device, dtype)
    except Exception as e:
        failures.append(f"loss check: {type(e).__name__}: {e}")
        check = {"max_rel_diff": None}
    failures += loss_failures(check, dtype)
    head = rows[-1] if rows else {}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "model": {
            k: shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
        },
        "batch": {
            "micro_batch_size": shape["micro_batch_size"],
            "num_microbatches": shape["num_microbatches"],
            "tokens_per_step": config.train.global_batch_size * m.seq_length,
        },
        "steps": shape["steps"],
        "warmup": shape["warmup"],
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "peak_source": peak_source,
        "rows": rows,
        "notes": notes,
        "failures": failures,
        "headline_mode": head.get("mode"),
        "tokens_per_s": head.get("tokens_per_s"),
        "mfu": head.get("mfu"),
        "ratio_vs_plain": head.get("ratio_vs_plain"),
        "max_loss_rel_diff_vs_float64_cpu": check["max_rel_diff"],
        "loss_check": check,
        "targets": TARGETS,
    }


def _git_commit() -> str | None:
    """The commit of the checkout this script runs from, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def format_report(r: dict) -> str:
    """The table printed at the end."""
    m = r["model"]
    peak = f"{r['peak_flops'] / 1e12:.1f} TFLOP/s ({r['peak_source']})" if r["peak_flops"] else r["peak_source"]
    lines = [
        f"ptdp GPU check on {r['device']} ({r['machine']}), torch {r['torch']}, ptdp {r['git_commit']}, {r['date']}",
        f"model: {m['num_layers']} layers, h {m['hidden_size']}, {m['num_attention_heads']} heads, "
        f"s {m['seq_length']}, V {m['vocab_size']}; {r['dtype']}; {r['batch']['tokens_per_step']:,} tokens/step; "
        f"median of {r['steps']} steps after {r['warmup']}; peak {peak}",
        f"{'mode':<8} {'ptdp s/step':>11} {'plain s/step':>12} {'ratio':>6} {'(target)':>9} "
        f"{'tokens/s':>10} {'MFU':>6} {'(target)':>9} {'peak mem':>9}",
    ]
    for row in r["rows"]:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        mfu_target = f">= {TARGETS['mfu_compiled_at_least']:.0%}" if row["mode"] == "compile" else ""
        mem = f"{row['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in row else "n/a"
        lines.append(
            f"{row['mode']:<8} {row['ptdp_step_s']:>11.4f} {row['plain_step_s']:>12.4f} "
            f"{row['ratio_vs_plain']:>6.3f} {'<= ' + str(TARGETS['ratio_vs_plain_at_most']):>9} "
            f"{row['tokens_per_s']:>10,.0f} {mfu:>6} {mfu_target:>9} {mem:>9}"
        )
    lines += [f"  {note}" for note in r["notes"]] + [f"  FAILED {failure}" for failure in r["failures"]]
    c = r["loss_check"]
    if c["max_rel_diff"] is not None:
        lines.append(
            f"loss vs float64 on the CPU (tiny model, {c['steps']} steps): max relative difference "
            f"{c['max_rel_diff']:.2e} in {r['dtype']} (rounding bound {c['bound']:.0e})"
        )
    if "max_rel_diff_float64_device_vs_cpu" in c:
        lines.append(f"  float64 on the device vs the CPU: {c['max_rel_diff_float64_device_vs_cpu']:.2e} (bound 1e-09)")
    if "elapsed_s" in r:
        lines.append(f"the check took {r['elapsed_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    report = run_check(args)
    report["elapsed_s"] = time.perf_counter() - started
    print(format_report(report))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if report["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
