"""The check of ptdp on one GPU, in stages: one command each, each with its own time budget, each
writing its JSON report as soon as it has a result.

    PYTHONPATH=src python3 benchmarks/gpu_check.py eager --output-dir DIR    # speed, eager; the loss check
    PYTHONPATH=src python3 benchmarks/gpu_check.py compile --output-dir DIR  # speed, compiled
    PYTHONPATH=src python3 benchmarks/gpu_check.py probes --output-dir DIR   # kernels, GEMMs, host syncs
    PYTHONPATH=src python3 benchmarks/gpu_check.py moe --output-dir DIR      # a small MoE model, grouped GEMM
    PYTHONPATH=src python3 benchmarks/gpu_check.py fp8 --output-dir DIR      # bf16, FP8 tensorwise, rowwise, blockwise
    PYTHONPATH=src python3 benchmarks/gpu_check.py zb --output-dir DIR       # 1f1b, zb-h1, zb-v at pp = 1
    python benchmarks/gpu_check.py STAGE --device cpu --quick --output-dir DIR  # a tiny model on the CPU
    benchmarks/gpu_run.sh first DIR; benchmarks/gpu_run.sh second DIR; benchmarks/gpu_run.sh third DIR

Stages (:data:`STAGES`, default budgets :data:`BUDGET_S`):

- ``eager``: the loss check (``gpu_loss.py``: a tiny model's losses on the device against float64
  on the CPU), then the eager speed row (``gpu_speed.py``: ptdp against the plain GPT on a 1.3B
  GPT, tokens/s, MFU, peak memory, which weight-gradient GEMM ran).
- ``compile``: the compiled speed row (ptdp's ``--compile`` against ``torch.compile`` of the plain
  GPT; the first steps' times include compiling); left out, with a note, when this ptdp has no
  ``--compile``.
- ``probes``: ``gpu_probes.py`` (the fused weight-gradient GEMM, the SDPA backends, GEMM TFLOP/s,
  a profiled step and its host synchronisations).
- ``moe``: ``gpu_moe.py`` (a small mixture-of-experts GPT: torch's rules for the experts' grouped
  GEMM, the grouped GEMM against the per-expert loop, a few training steps whose loss must fall,
  step time and tokens/s).
- ``fp8``: ``gpu_fp8.py`` (the 1.3B GPT trained the same steps on the same batch in bfloat16, then
  with FP8 GEMMs under the tensorwise, rowwise and blockwise recipes: tokens/s, MFU, peak memory and the
  loss difference against bfloat16 per run, each run a JSON line when it ends).
- ``zb``: ``gpu_zb.py`` (the 1.3B GPT trained the same steps on the same batch, 4 microbatches, from
  the same weights under the 1f1b, zb-h1 and zb-v pipeline schedules at pp = 1: per-step losses,
  which must agree with 1f1b's within rounding, and each step time against 1f1b's).

Each stage writes ``DIR/gpu_check_<stage>.json`` (``gpu_report.py``: rewritten after each result,
``"complete": false`` until the stage ends) and prints a summary. A stage's models are built and
its first step run whatever the budget; timed steps and further probes stop when the budget would
be exceeded (``budget_exhausted``, a note). Targets (reported, not enforced): MFU >= 50% compiled,
ratio vs plain <= 1.05. Exit code 1 when an item fails, a loss differs from float64 by more than
rounding explains, the fused weight-gradient GEMM fell back, a steady-state step synchronises
the host, the MoE model's loss does not fall or its grouped GEMM fails, or an FP8 stage run's loss
is not finite or does not fall, or a zero-bubble run's loss differs from 1f1b's by more than
rounding explains; else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from gpu_fp8 import run_fp8_stage
from gpu_loss import loss_check, loss_failures
from gpu_models import FULL, QUICK, speed_config
from gpu_moe import MOE_FULL, MOE_QUICK, run_moe_stage
from gpu_probes import probe_gemms, probe_model, probe_sdpa, probe_step, probe_wgrad
from gpu_report import Budget, StageReport, report_path, run_header
from gpu_speed import TARGETS, flops_per_token, measure_mode, peak_flops
from gpu_zb import run_zb_stage, zb_shape
from plain_gpt import with_compile

STAGES = ("eager", "compile", "probes", "moe", "fp8", "zb")
BUDGET_S = {"eager": 150.0, "compile": 420.0, "probes": 150.0, "moe": 60.0, "fp8": 180.0, "zb": 120.0}
"""Default seconds of wall time per stage (``gpu_run.sh`` passes the same)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--output-dir", required=True, metavar="DIR", help="the report goes to DIR/gpu_check_STAGE.json")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="a tiny model (2 layers, h=64, s=64)")
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds for the stage (default: eager 150, compile 420, probes 150, moe 60, fp8 180, zb 120)",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "float64"),
        help="precision of the timed models (default: bfloat16 on a GPU and for fp8, else float32 on a CPU)",
    )
    ap.add_argument("--num-layers", type=int, help="layers of the timed model (default 24, moe 8; --quick 2)")
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
    for name in ("peak_tflops", "budget"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        ap.error(f"--output-dir {args.output_dir}: {e}")
    if not os.access(args.output_dir, os.W_OK):
        ap.error(f"--output-dir {args.output_dir}: not a writable folder")
    return args


def _describe(report: StageReport, config, shape: dict, peak: float | None, peak_source: str) -> None:
    m = config.model
    report.update(
        model={k: shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")},
        batch={
            "micro_batch_size": shape["micro_batch_size"],
            "num_microbatches": shape["num_microbatches"],
            "tokens_per_step": config.train.global_batch_size * m.seq_length,
        },
        flops_per_token=flops_per_token(config),
        peak_flops=peak,
        peak_source=peak_source,
    )


def run_speed(mode: str, args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """The speed row of ``mode`` (``eager`` or ``compile``) into ``report["rows"]``."""
    config = speed_config(shape, dtype)
    if mode == "compile":
        config = with_compile(config)
        if config is None:
            report.note("compile: not measured, this ptdp has no --compile option")
            return
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    _describe(report, config, shape, peak, peak_source)
    report.update(steps=shape["steps"], warmup=shape["warmup"], targets=TARGETS, rows=[])
    rows = report.data["rows"]

    def publish(row: dict) -> None:
        if not any(r is row for r in rows):
            rows.append(row)
        report.write()

    try:
        row = measure_mode(config, mode, shape, device, budget, peak, publish)
    except Exception as e:  # the report keeps what the row had
        report.fail(f"{mode}: {type(e).__name__}: {e}")
        return
    if row["stopped_by_budget"]:
        report.out_of_budget(f"{mode}: timing after {row['timed_steps']} of {row['requested_steps']} steps")
    record = row["wgrad_fused_gemm"]
    if record["status"] == "fell back":
        report.fail(f"{mode}: the fused float32 weight-gradient GEMM fell back ({record['error']})")


def run_eager(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """The loss check, then the eager speed row."""
    try:
        check = loss_check(device, dtype)
    except Exception as e:
        report.fail(f"loss check: {type(e).__name__}: {e}")
        check = {"max_rel_diff": None}
    report.update(loss_check=check, max_loss_rel_diff_vs_float64_cpu=check["max_rel_diff"])
    for failure in loss_failures(check, dtype):
        report.fail(failure)
    run_speed("eager", args, shape, dtype, device, budget, report)


def run_compile(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    run_speed("compile", args, shape, dtype, device, budget, report)


def run_probes(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """Each probe into ``report["probes"]``, one after another while the budget lasts."""
    config = speed_config(shape, dtype)
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    _describe(report, config, shape, peak, peak_source)
    probes: dict = {}
    report.update(probes=probes)
    model: list = []  # the probes' stage, built for the first probe that needs it

    def stage():
        if not model:
            model.append(probe_model(shape, dtype, device))
        return model[0]

    items = (  # the backends' own restrictions last: a kernel failing badly there harms nothing after it
        ("wgrad", lambda: probe_wgrad(config, device, budget)),
        ("gemm", lambda: probe_gemms(config, device, budget, peak)),
        ("step", lambda: probe_step(stage(), device, budget)),
        ("sdpa", lambda: probe_sdpa(stage(), device, budget)),
    )
    for i, (name, probe) in enumerate(items):
        if i and not budget.allows(0):
            probes[name] = {"status": "not run: the stage's budget was spent"}
            report.out_of_budget(f"probe {name}")
            continue
        try:
            probes[name] = probe()
        except Exception as e:
            probes[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            report.fail(f"probe {name}: {type(e).__name__}: {e}")
            continue
        report.write()
        if name == "wgrad" and probes[name]["status"] == "fell back":
            report.fail(f"probe wgrad: the fused float32 weight-gradient GEMM fell back ({probes[name]['error']})")
        syncs = probes[name].get("host_syncs", {}) if name == "step" else {}
        if syncs.get("per_step"):
            report.fail(f"probe step: {syncs['per_step']:g} host synchronisations per steady-state step (expected 0)")


def run_moe(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """The MoE model's items into ``report["moe"]`` (``gpu_moe.py``)."""
    run_moe_stage(shape, dtype, device, budget, report)


def run_fp8(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """The runs without and with FP8 into ``report["fp8"]`` (``gpu_fp8.py``)."""
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    _describe(report, speed_config(shape, dtype), shape, peak, peak_source)
    report.update(steps=shape["steps"], warmup=shape["warmup"])
    run_fp8_stage(shape, dtype, device, budget, report, peak)


def run_zb(args, shape: dict, dtype: str, device: torch.device, budget: Budget, report) -> None:
    """The 1f1b, zb-h1 and zb-v runs into ``report["zb"]`` (``gpu_zb.py``)."""
    shape = zb_shape(shape)
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    _describe(report, speed_config(shape, dtype), shape, peak, peak_source)
    report.update(steps=shape["steps"], warmup=shape["warmup"])
    run_zb_stage(shape, dtype, device, budget, report)


RUNNERS = {
    "eager": run_eager,
    "compile": run_compile,
    "probes": run_probes,
    "moe": run_moe,
    "fp8": run_fp8,
    "zb": run_zb,
}


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    budget = Budget(args.budget or BUDGET_S[args.stage], start=started)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = (MOE_QUICK, MOE_FULL) if args.stage == "moe" else (QUICK, FULL)
    shape = dict(shapes[0] if args.quick else shapes[1])
    overrides = ("steps", "warmup", "num_layers", "micro_batch_size")
    shape.update({k: getattr(args, k) for k in overrides if getattr(args, k) is not None})
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" or args.stage == "fp8" else "float32")
    command = ["python3", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
    report = StageReport(
        report_path(args.output_dir, args.stage), args.stage, budget, run_header(device, dtype, command)
    )
    try:
        RUNNERS[args.stage](args, shape, dtype, device, budget, report)
    except Exception as e:
        report.fail(f"{args.stage}: {type(e).__name__}: {e}")
    report.finish()
    print(format_report(report.data))
    if report.data["failures"]:
        sys.exit(1)


def format_report(r: dict) -> str:
    """The summary printed at the end of a stage."""
    lines = [
        f"ptdp GPU check, stage {r['stage']}, on {r['device']} ({r['machine']}), torch {r['torch']}, "
        f"ptdp {r['git_commit']}, {r['date']}"
    ]
    if "model" in r:
        m = r["model"]
        peak = f"{r['peak_flops'] / 1e12:.1f} TFLOP/s ({r['peak_source']})" if r["peak_flops"] else r["peak_source"]
        lines.append(
            f"model: {m['num_layers']} layers, h {m['hidden_size']}, {m['num_attention_heads']} heads, "
            f"s {m['seq_length']}, V {m['vocab_size']}; {r['dtype']}; {r['batch']['tokens_per_step']:,} tokens/step; "
            f"peak {peak}"
        )
    if "loss_check" in r and r["loss_check"]["max_rel_diff"] is not None:
        c = r["loss_check"]
        lines.append(
            f"loss vs float64 on the CPU (tiny model, {c['steps']} steps): max relative difference "
            f"{c['max_rel_diff']:.2e} in {r['dtype']} (rounding bound {c['bound']:.0e})"
        )
        if "max_rel_diff_float64_device_vs_cpu" in c:
            lines.append(
                f"  float64 on the device vs the CPU: {c['max_rel_diff_float64_device_vs_cpu']:.2e} (bound 1e-09)"
            )
    lines += _format_rows(r.get("rows", []))
    lines += _format_probes(r.get("probes", {}))
    lines += _format_moe(r.get("moe"))
    lines += _format_fp8(r.get("fp8"))
    lines += _format_zb(r.get("zb"))
    lines += [f"  {note}" for note in r["notes"]] + [f"  FAILED {failure}" for failure in r["failures"]]
    lines.append(f"the stage took {r['elapsed_s']:.0f} s of its {r['budget_s']:g} s budget")
    return "\n".join(lines)


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _format_rows(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        f"{'mode':<8} {'steps':>5} {'ptdp s/step':>11} {'plain s/step':>12} {'ratio':>6} {'(target)':>9} "
        f"{'tokens/s':>10} {'MFU':>6} {'peak mem':>9} {'wgrad GEMM':>10}"
    ]
    for row in rows:
        mem = f"{row['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in row else "n/a"
        wgrad = row.get("wgrad_fused_gemm", {}).get("status", "n/a")
        lines.append(
            f"{row['mode']:<8} {row['timed_steps']:>5} {_num(row.get('ptdp_step_s'), '.4f'):>11} "
            f"{_num(row.get('plain_step_s'), '.4f'):>12} {_num(row.get('ratio_vs_plain'), '.3f'):>6} "
            f"{'<= ' + str(TARGETS['ratio_vs_plain_at_most']):>9} {_num(row.get('tokens_per_s'), ',.0f'):>10} "
            f"{_num(row.get('mfu'), '.1%'):>6} {mem:>9} {wgrad[:10]:>10}"
        )
        if "first_step_s" in row:
            first = ", ".join(f"{k} {v:.1f} s" for k, v in row["first_step_s"].items())
            lines.append(
                f"  first step (compiling in compile mode): {first}; models built in {row.get('build_s', 0):.1f} s"
            )
    return lines


def _format_probes(probes: dict) -> list[str]:
    lines = []
    for name, p in probes.items():
        status = p.get("status")
        if name == "sdpa" and "default" in p:
            ok = ", ".join(
                f"{b} {e['fwd_bwd_s'] * 1e3:.2f} ms" if e.get("ok") else f"{b} no" for b, e in p["backends"].items()
            )
            lines.append(f"probe sdpa: default dispatch {p['default']['backend']}; fwd+bwd {ok}")
        elif name == "gemm" and "gemms" in p:
            cells = [
                f"{layer} {e['forward']['tflops']:.1f}"
                for layer, e in p["gemms"].items()
                if "tflops" in e.get("forward", {})
            ]
            lines.append(f"probe gemm: forward TFLOP/s {', '.join(cells)}")
        elif name == "step" and "attention" in p:
            syncs = p["host_syncs"]
            sync_text = syncs.get("status") or f"{syncs['per_step']:g} host syncs per step"
            lines.append(f"probe step: attention {p['attention']['backend']}; {sync_text}")
        else:
            lines.append(f"probe {name}: {status}" + (f" ({p['error']})" if p.get("error") else ""))
    return lines


def _format_moe(moe: dict | None) -> list[str]:
    if not moe:
        return []
    m = moe["model"]
    lines = [
        f"MoE model: {m['num_layers']} layers, h {m['hidden_size']}, s {m['seq_length']}, V {m['vocab_size']}, "
        f"{m['num_experts']} experts of width {m['expert_ffn']}, top-{m['topk']}, "
        f"{m.get('parameters', 0):,} parameters; {moe['batch']['tokens_per_step']:,} tokens/step"
    ]
    rules = moe.get("grouped_gemm")
    if rules:
        lines.append(f"grouped GEMM: {rules.get('status', 'not tried')} (CUTLASS kernel: {rules['cutlass_kernel']})")
    for r in moe["gemm"]:
        ms = {k: None if r[k] is None else 1e3 * r[k] for k in ("grouped_s", "loop_s")}
        lines.append(
            f"  experts E {r['num_experts']}, h {r['hidden']}, F {r['ffn']}, {r['rows']:,} rows: grouped "
            f"{_num(ms['grouped_s'], '.3f')} ms, loop {_num(ms['loop_s'], '.3f')} ms, "
            f"grouped / loop {_num(r['grouped_over_loop'], '.3f')}"
        )
    for key, name in (("training", "training"), ("training_fp8_rowwise", "FP8 rowwise")):
        run = moe.get(key)
        if run:
            losses = ", ".join(f"{x:.4f}" for x in run["losses"])
            lines.append(
                f"{name} ({run.get('timed_steps', 0)} timed steps after {run['warmup']}): step "
                f"{_num(run.get('median_step_s'), '.4f')} s, {_num(run.get('tokens_per_s'), ',.0f')} tokens/s; "
                f"losses {losses}"
                + (
                    f"; last loss - bf16's {run['last_loss_diff_vs_bf16']:+.4f}, tokens/s / bf16's "
                    f"{_num(run.get('tokens_per_s_ratio_vs_bf16'), '.3f')}"
                    if "last_loss_diff_vs_bf16" in run
                    else ""
                )
            )
    return lines


def _format_fp8(fp8: dict | None) -> list[str]:
    if not fp8:
        return []
    lines = [
        f"{'run':<15} {'steps':>5} {'s/step':>8} {'tokens/s':>10} {'vs base':>7} {'MFU':>6} {'peak mem':>9} "
        f"{'last loss':>9} {'rel diff':>9} {'max rel diff':>12}"
    ]
    for run in fp8["runs"]:
        mem = f"{run['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in run else "n/a"
        last = run["losses"][-1] if run.get("losses") else None
        lines.append(
            f"{run['name']:<15} {run.get('timed_steps', 0):>5} {_num(run.get('median_step_s'), '.4f'):>8} "
            f"{_num(run.get('tokens_per_s'), ',.0f'):>10} {_num(run.get('tokens_per_s_vs_baseline'), '.3f'):>7} "
            f"{_num(run.get('mfu'), '.1%'):>6} {mem:>9} {_num(last, '.4f'):>9} "
            f"{_num(run.get('last_loss_rel_diff'), '+.2e'):>9} {_num(run.get('max_loss_rel_diff'), '.2e'):>12}"
        )
        paths = run.get("gemm_path", {})
        if "forward" in paths:
            lines.append("  " + ", ".join(f"{g}: {p}" for g, p in paths.items()))
    return lines


def _format_zb(zb: dict | None) -> list[str]:
    if not zb:
        return []
    lines = [
        f"{'schedule':<8} {'steps':>5} {'s/step':>8} {'tokens/s':>10} {'vs 1f1b':>7} {'peak mem':>9} "
        f"{'last loss':>9} {'max rel diff':>12} {'(bound)':>7}"
    ]
    for run in zb["runs"]:
        mem = f"{run['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in run else "n/a"
        last = run["losses"][-1] if run.get("losses") else None
        lines.append(
            f"{run['name']:<8} {run.get('timed_steps', 0):>5} {_num(run.get('median_step_s'), '.4f'):>8} "
            f"{_num(run.get('tokens_per_s'), ',.0f'):>10} {_num(run.get('step_s_vs_1f1b'), '.3f'):>7} {mem:>9} "
            f"{_num(last, '.4f'):>9} {_num(run.get('max_loss_rel_diff'), '.2e'):>12} {zb['loss_bound']:>7.0e}"
        )
    return lines


if __name__ == "__main__":
    main()
