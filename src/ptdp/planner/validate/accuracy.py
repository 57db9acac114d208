"""Validation of the planner's models against published training runs.

``published_runs.csv`` (A100-80GB: Megatron SC21, Narayanan et al., arXiv:2104.04473, Table 1;
Korthikanti et al. 2022, arXiv:2205.05198, Table 5 and Figure 1) and ``published_runs_h100.csv``
(Megatron-LM's README tables, the Llama 3 paper's Table 4), read by
:mod:`ptdp.planner.validate.published`. Each run is evaluated at its exact layout: :func:`validate`
and :func:`validate_h100` give one :class:`ValidationRow` per reported number, :func:`summarize` the
mean and max absolute error per metric, :func:`fit_arch` refits ``PerfConstants.arch_fits``.
Run ``python -m ptdp.planner.validate.accuracy [CSV]``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster, GiB
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.params import bytes_per_param, stage_param_counts
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.planner.validate.published import H100Run, PublishedRun, default_csv, load_h100_runs, load_published_runs

__all__ = [
    "ACT_NONE",
    "ACT_SEQSEL",
    "H100_STEP",
    "H100_STEP_CP",
    "H100_STEP_FP8",
    "ITER_TIME",
    "METRICS",
    "PARAMS_OPT",
    "TFLOPS",
    "ValidationRow",
    "fit_arch",
    "fit_check",
    "fit_constants",
    "fitted_runs",
    "format_validation_table",
    "h100_fit_check",
    "h100_log_error",
    "hopper_runs",
    "is_h100_table",
    "layout_label",
    "loso_a100",
    "loso_h100",
    "main",
    "run_constants",
    "speed_log_error",
    "summarize",
    "validate",
    "validate_h100",
]

TFLOPS = "TFLOP/s per GPU"
ITER_TIME = "iteration time (s)"
ACT_NONE = "activations, TP only, no recompute (GiB)"
ACT_SEQSEL = "activations, SP + selective (GiB)"
PARAMS_OPT = "params + optimizer, mean over stages (GiB)"
#: the H100-format tables' metrics (their rows' GPUs: H100s, H200s, A100s; each row names its own)
H100_STEP = "step time, bf16 runs (s)"
H100_STEP_CP = "step time, bf16 runs with cp (s)"
H100_STEP_FP8 = "step time, FP8 runs (s)"
METRICS = (TFLOPS, ITER_TIME, ACT_NONE, ACT_SEQSEL, PARAMS_OPT, H100_STEP, H100_STEP_CP, H100_STEP_FP8)


@dataclass(frozen=True)
class ValidationRow:
    """One reported number next to the prediction; ``error`` = predicted / reported - 1."""

    name: str
    layout: str
    metric: str
    reported: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.reported - 1.0


def layout_label(layout: Candidate) -> str:
    """Short layout text: ``t8 p8 d1 v3 b1 B64 full`` (+ ``sp``)."""
    label = (
        f"t{layout.tp} p{layout.pp} d{layout.dp} v{layout.virtual_stages} b{layout.micro_batch_size} "
        f"B{layout.global_batch_size} {layout.recompute}"
    )
    return label + (" sp" if layout.parallel.sequence_parallel else "")


def validate(
    runs: list[PublishedRun],
    constants: PerfConstants = DEFAULT_CONSTANTS,
    constants_of: Callable[[PublishedRun], PerfConstants] | None = None,
) -> list[ValidationRow]:
    """Evaluate every run at its exact layout (its time with ``constants_of(run)`` if given, else
    ``constants``); one row per reported number.

    Memory (Korthikanti Figure 1, first pipeline stage): activation bytes without recompute or SP
    ("none") and with SP + selective recompute ("seq+sel"), once per model. Params + optimizer state:
    Figure 1's ``18 * 12 l h^2 / (t p)`` bytes, compared with the mean over stages of the exact count x 18.
    """
    out = []
    seen_memory: set[str] = set()
    for run in runs:
        gpu = CATALOG[run.gpu]
        cluster = Cluster(gpu, run.layout.num_gpus)
        label = layout_label(run.layout)
        perf = evaluate_performance(run.model, run.layout, cluster, constants_of(run) if constants_of else constants)
        if run.reported_tflops is not None:
            out.append(ValidationRow(run.name, label, TFLOPS, run.reported_tflops, perf.tflops_per_gpu / 1e12))
        if run.reported_iteration_time is not None:
            out.append(ValidationRow(run.name, label, ITER_TIME, run.reported_iteration_time, perf.step_time))
        if run.reported_act_none_gib is not None and run.name not in seen_memory:
            seen_memory.add(run.name)
            none = run.layout.replace(recompute="none", sequence_parallel=False)
            seqsel = run.layout.replace(recompute="selective", sequence_parallel=True)
            mem_none = memory_breakdown(run.model, none, gpu)
            out.append(
                ValidationRow(
                    run.name, layout_label(none), ACT_NONE, run.reported_act_none_gib, mem_none.activations / GiB
                )
            )
            if run.reported_act_seqsel_gib is not None:
                mem_seqsel = memory_breakdown(run.model, seqsel, gpu)
                out.append(
                    ValidationRow(
                        run.name,
                        layout_label(seqsel),
                        ACT_SEQSEL,
                        run.reported_act_seqsel_gib,
                        mem_seqsel.activations / GiB,
                    )
                )
            if run.reported_params_opt_gib is not None:
                counts = stage_param_counts(run.model, run.layout.tp, run.layout.pp)
                per_param = sum(
                    bytes_per_param(run.layout.precision, run.layout.dp, run.layout.parallel.use_distributed_optimizer)
                )
                out.append(
                    ValidationRow(
                        run.name,
                        layout_label(none),
                        PARAMS_OPT,
                        run.reported_params_opt_gib,
                        sum(counts) / len(counts) * per_param / GiB,
                    )
                )
    return out


def speed_log_error(runs: list[PublishedRun], constants: PerfConstants) -> float:
    """Mean of ``ln(predicted / reported)^2`` over the TFLOP/s and iteration-time rows: the
    least-squares objective of :func:`fit_constants` (symmetric in over- and under-prediction)."""
    errors = [math.log1p(r.error) for r in validate(runs, constants) if r.metric in (TFLOPS, ITER_TIME)]
    return sum(e * e for e in errors) / len(errors)


def fit_constants(
    runs: list[PublishedRun],
    base: PerfConstants = DEFAULT_CONSTANTS,
    *,
    gemm_peak_fractions=None,
    hbm_efficiencies=None,
) -> tuple[PerfConstants, float]:
    """Grid least squares (:func:`speed_log_error`) of the two fitted constants,
    ``gemm_peak_fraction`` (default grid 0.70-0.85 by 0.005) and ``hbm_efficiency`` (0.60-1.00 by
    0.025), every other constant as in ``base``. Returns the best constants and their objective."""
    gemm = gemm_peak_fractions or [round(0.70 + 0.005 * i, 3) for i in range(31)]
    hbm = hbm_efficiencies or [round(0.60 + 0.025 * i, 3) for i in range(17)]
    scored = (
        (speed_log_error(runs, c), c)
        for c in (dataclasses.replace(base, gemm_peak_fraction=g, hbm_efficiency=e) for g in gemm for e in hbm)
    )
    best = min(scored, key=lambda sc: sc[0])
    return best[1], best[0]


def run_constants(run: H100Run, constants: PerfConstants = DEFAULT_CONSTANTS) -> PerfConstants:
    """The time model's constants for one published H100 run: its GPU generation's fit
    (:meth:`PerfConstants.for_gpu`) and the communication overlap the run used: ``tp_comm_overlap``
    (Transformer Engine's ring exchange, ``(tp - 1) / tp`` hidden), ``async_tp`` (PyTorch's, the forward
    pass's), ``pp_overlap`` (Megatron's
    ``overlap_p2p_comm``, the Llama 3 paper's asynchronous point-to-point) and ``overlap_window``
    (``--overlap-grad-reduce --overlap-param-gather``, the Llama 3 paper's asynchronous FSDP).
    """
    c = dataclasses.replace(
        constants.for_gpu(CATALOG[run.gpu]),
        tp_overlap=0.0,
        dp_overlap=0.0,
        overlap_window=False,
        cp_implementation=run.cp_implementation,
    )
    return c.with_overlap(
        overlap_grad_reduce=run.dp_overlap,
        tp_comm_overlap=run.tp_overlap,
        pp_overlap=run.pp_overlap,
        async_tp=run.async_tp,
    )


def h100_name(run: H100Run) -> str:
    """``Llama 3 8B (8 GPUs)``, the GPU named where it is not the H100 SXM: ``(8 x a100-80gb)``."""
    gpus = run.layout.num_gpus
    return f"{run.name} ({gpus} GPUs)" if run.gpu in ("h100-sxm", "h100") else f"{run.name} ({gpus} x {run.gpu})"


def h100_label(run: H100Run) -> str:
    """:func:`layout_label` with ``c{cp}``, ``tpo`` where the run overlapped its TP communication,
    ``fp8`` (``fp8w``: with FP8 weights) for FP8 runs and ``g16`` for bf16 gradients."""
    lay = run.layout
    precision = (" fp8w" if lay.fp8_param_gather else " fp8") if lay.precision == "fp8" else ""
    return (
        layout_label(lay)
        + (f" c{lay.cp}" if lay.cp > 1 else "")
        + (" tpo" if run.tp_overlap else " atp" if run.async_tp else "")
        + precision
        + (" g16" if lay.bf16_grads else "")
    )


def validate_h100(runs: list[H100Run], constants: PerfConstants = DEFAULT_CONSTANTS) -> list[ValidationRow]:
    """One row per run: the step time its source implies (its FLOP convention,
    :func:`ptdp.planner.validate.published.reported_step_time`) next to the planner's, at the run's exact
    layout with :func:`run_constants`; metric :data:`H100_STEP`, or :data:`H100_STEP_FP8` /
    :data:`H100_STEP_CP` for the FP8 runs and the runs with context parallelism (summarised apart,
    outside the fit: :func:`fitted_runs`)."""
    out = []
    for run in runs:
        c = run_constants(run, constants)
        perf = evaluate_performance(run.model, run.layout, Cluster(CATALOG[run.gpu], run.layout.num_gpus), c)
        label = h100_label(run)
        metric = H100_STEP_FP8 if run.layout.precision == "fp8" else H100_STEP if run.layout.cp == 1 else H100_STEP_CP
        out.append(ValidationRow(h100_name(run), label, metric, run.step_time, perf.step_time))
    return out


def fitted_runs(runs: list[H100Run]) -> list[H100Run]:
    """The runs the Hopper fit and its targets use: bf16 runs without context parallelism. The cp
    and FP8 rows are evaluated and shown, but their models (:mod:`ptdp.planner.time.cp_exchange`,
    :mod:`ptdp.planner.memory.fp8`) are newer than this fit and are judged on their own."""
    return [run for run in runs if run.layout.cp == 1 and run.layout.precision != "fp8"]


def h100_log_error(runs: list[H100Run], constants: PerfConstants) -> float:
    """Mean ``ln(predicted / reported)^2`` of :func:`validate_h100` over :func:`fitted_runs`: the
    objective of :func:`fit_arch`."""
    errors = [math.log1p(r.error) for r in validate_h100(fitted_runs(runs), constants)]
    return sum(e * e for e in errors) / len(errors)


def fit_arch(
    runs: list[H100Run],
    base: PerfConstants = DEFAULT_CONSTANTS,
    arch: str = "hopper",
    *,
    gemm_peak_fractions=None,
    hbm_efficiencies=None,
) -> tuple[PerfConstants, float]:
    """Grid least squares (:func:`h100_log_error`) of ``arch``'s ``gemm_peak_fraction`` (default
    grid 0.50-0.80 by 0.01) and ``hbm_efficiency`` (0.60-1.00 by 0.05) in ``base.arch_fits``, its
    ``gemm_half_dim`` kept. Returns the best constants and their objective."""
    fits = {fit[0]: fit for fit in base.arch_fits}
    half_dim = fits[arch][2] if arch in fits else base.gemm_half_dim
    gemm = gemm_peak_fractions or [round(0.50 + 0.01 * i, 2) for i in range(31)]
    hbm = hbm_efficiencies or [round(0.60 + 0.05 * i, 2) for i in range(9)]

    def with_fit(g: float, e: float) -> PerfConstants:
        others = tuple(fit for fit in base.arch_fits if fit[0] != arch)
        return dataclasses.replace(base, arch_fits=others + ((arch, g, half_dim, e),))

    best = min(
        ((h100_log_error(runs, c), c) for c in (with_fit(g, e) for g in gemm for e in hbm)), key=lambda sc: sc[0]
    )
    return best[1], best[0]


def hopper_runs(runs: list[H100Run]) -> list[H100Run]:
    """The runs on a GPU of the architecture :func:`fit_arch` fits (``hopper``)."""
    return [run for run in runs if CATALOG[run.gpu].arch == "hopper"]


def loso_h100(runs: list[H100Run], constants: PerfConstants = DEFAULT_CONSTANTS) -> list[ValidationRow]:
    """:func:`validate_h100` with each Hopper run predicted by the Hopper fit (:func:`fit_arch`) over
    the :func:`fitted_runs` of the other sources (:attr:`H100Run.source_key`), leave-one-source-out
    (predicted NaN where no other source has such runs); other GPUs' runs with ``constants``, whose
    fit uses none of these sources. Rows in ``runs``' order."""
    pool = frozenset(fitted_runs(hopper_runs(runs)))
    out = []
    for run in runs:
        hopper = CATALOG[run.gpu].arch == "hopper"
        fit = _fit_without(pool, run.source_key, constants) if hopper else constants
        row = validate_h100([run], fit or constants)[0]
        out.append(row if fit else dataclasses.replace(row, predicted=math.nan))
    return out


@lru_cache(maxsize=64)
def _fit_without(pool: frozenset[H100Run], key: str, constants: PerfConstants) -> PerfConstants | None:
    """:func:`fit_arch` over the runs of ``pool`` not from source ``key``, in a fixed order; None
    if there are none."""
    train = sorted((r for r in pool if r.source_key != key), key=lambda r: (r.source, r.name, r.step_time))
    return fit_arch(train, constants)[0] if train else None


def loso_a100(runs: list[PublishedRun], constants: PerfConstants = DEFAULT_CONSTANTS) -> list[ValidationRow]:
    """:func:`validate` with each source's runs timed by :func:`fit_constants` over the other
    sources' runs, leave-one-source-out (the memory rows fit nothing; NaN with a single source); rows in
    :func:`validate`'s order."""
    fits = {}
    for key in dict.fromkeys(run.source for run in runs):
        train = [r for r in runs if r.source != key]
        fits[key] = fit_constants(train, constants)[0] if train else None
    rows = validate(runs, constants, lambda run: fits[run.source] or constants)
    if all(fits.values()):
        return rows
    return [dataclasses.replace(r, predicted=math.nan) if r.metric in (TFLOPS, ITER_TIME) else r for r in rows]


def fit_check(runs: list[PublishedRun]) -> list[tuple[str, str, float, float]]:
    """(name, layout, predicted total GiB, capacity GiB) of every run under the memory model."""
    out = []
    for run in runs:
        gpu = CATALOG[run.gpu]
        mem = memory_breakdown(run.model, run.layout, gpu)
        out.append((run.name, layout_label(run.layout), mem.total / GiB, gpu.memory_bytes / GiB))
    return out


def summarize(rows: list[ValidationRow]) -> dict[str, tuple[int, float, float]]:
    """Per metric: (rows, mean absolute error, max absolute error), errors as fractions."""
    out = {}
    for metric in METRICS:
        errors = [abs(r.error) for r in rows if r.metric == metric and not math.isnan(r.error)]
        if errors:
            out[metric] = (len(errors), sum(errors) / len(errors), max(errors))
    return out


def format_validation_table(rows: list[ValidationRow], loso: list[ValidationRow] | None = None) -> str:
    """Markdown: model, layout, metric, reported, predicted, error % (grouped by metric), with the
    error of ``loso`` (the same rows, in the same order, predicted leave-one-source-out) beside;
    then the mean and max absolute error per metric, in-sample and leave-one-source-out."""
    if loso is not None and [r.reported for r in loso] != [r.reported for r in rows]:
        raise ValueError("loso must hold the same rows as rows, in the same order")
    extra = " error, its source left out |" if loso else ""
    lines = [
        f"| model | layout | metric | reported | predicted | error |{extra}",
        "|---|---|---|---|---|---|" + ("---|" if loso else ""),
    ]
    for i in sorted(range(len(rows)), key=lambda i: METRICS.index(rows[i].metric)):
        r = rows[i]
        line = f"| {r.name} | {r.layout} | {r.metric} | {r.reported:.2f} | {r.predicted:.2f} | {100 * r.error:+.1f}% |"
        held_out = "n/a" if loso and math.isnan(loso[i].error) else f"{100 * loso[i].error:+.1f}%" if loso else ""
        lines.append(line + (f" {held_out} |" if loso else ""))
    held = summarize(loso) if loso else {}
    extra = " mean, its source left out | max, its source left out |" if loso else ""
    lines += [
        "",
        f"| metric | rows | mean abs. error | max abs. error |{extra}",
        "|---|---|---|---|" + ("---|---|" if loso else ""),
    ]
    for metric, (n, mae, worst) in summarize(rows).items():
        line = f"| {metric} | {n} | {100 * mae:.2f}% | {100 * worst:.2f}% |"
        lines.append(
            line + (f" {100 * held[metric][1]:.2f}% | {100 * held[metric][2]:.2f}% |" if metric in held else "")
        )
    return "\n".join(lines)


def is_h100_table(path: str | Path) -> bool:
    """True for a table in the format of ``published_runs_h100.csv`` (it names FLOP conventions)."""
    with open(path, newline="", encoding="utf-8") as f:
        return "flop_convention" in (csv.DictReader(f).fieldnames or [])


def h100_fit_check(runs: list[H100Run]) -> list[tuple[str, str, float, float]]:
    """(name, layout, predicted total GiB, capacity GiB) of every H100 run under the memory model."""
    out = []
    for run in runs:
        gpu = CATALOG[run.gpu]
        mem = memory_breakdown(run.model, run.layout, gpu)
        out.append((h100_name(run), h100_label(run), mem.total / GiB, gpu.memory_bytes / GiB))
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m ptdp.planner.validate.accuracy [CSV] [--fit]``: the validation table and the memory
    check; with ``--fit`` also refit the two fitted constants (of the table's GPU generation) and
    print them."""
    argv = sys.argv[1:] if argv is None else argv
    fit = "--fit" in argv
    argv = [a for a in argv if a != "--fit"]
    path = argv[0] if argv else default_csv()
    if path is None:
        raise SystemExit("published_runs.csv not found; pass its path or set PTDP_PUBLISHED_RUNS")
    if is_h100_table(path):
        h100 = load_h100_runs(path)
        print(format_validation_table(validate_h100(h100)))
        print()
        if fit:
            best, score = fit_arch(h100)
            print(
                f"least squares: arch_fits={best.arch_fits} mean ln-error^2={score:.6f} "
                f"(defaults: {h100_log_error(h100, DEFAULT_CONSTANTS):.6f})\n"
            )
        checks = h100_fit_check(h100)
    else:
        runs = load_published_runs(path)
        print(format_validation_table(validate(runs)))
        print()
        if fit:
            best, score = fit_constants(runs)
            print(
                f"least squares: gemm_peak_fraction={best.gemm_peak_fraction} "
                f"hbm_efficiency={best.hbm_efficiency} mean ln-error^2={score:.6f} "
                f"(defaults: {speed_log_error(runs, DEFAULT_CONSTANTS):.6f})\n"
            )
        checks = fit_check(runs)
    print("| model | layout | predicted total GiB | capacity GiB |")
    print("|---|---|---|---|")
    for name, label, total, cap in checks:
        print(f"| {name} | {label} | {total:.1f} | {cap:.0f} |")


if __name__ == "__main__":
    main()
