"""The published mixture-of-experts training runs the planner is checked against
(``benchmarks/data/published_moe_validation.csv``, chosen from ``published_moe_runs.csv``, whose notes
name each source and its FLOP convention), and their predictions.

Each row names a model preset (:data:`~ptdp.planner.inputs.models.MOE_PRESETS`), the GPU, the layout
(tp, cp, pp, v, ep, etp, micro and global batch, sequence parallelism, the sharding strategy,
recompute and ``--recompute-modules``), the multi-token-prediction layers trained, the overlap the
run used (``moe_overlap``: the EP all-to-alls behind compute; ``dp_overlap``, ``tp_overlap``,
``pp_overlap`` as in ``published_runs_h100.csv``), its CUDA graphs (``cuda_graph_impl``,
``cuda_graph_scope``: Megatron-Core's values, empty for none; columns a table may leave out), and
the reported tokens/s per GPU (or seconds per step), compared as the step time it implies:
``B s / (tokens/s per GPU x GPUs)``.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ptdp.config.keywords import RaisingParser, keyword_namespace
from ptdp.errors import ConfigError
from ptdp.planner.candidate import Candidate, Plan
from ptdp.planner.inputs.hardware import CATALOG, TFLOPS, GiB
from ptdp.planner.inputs.models import MOE_PRESETS
from ptdp.planner.inputs.moe_model import with_mtp
from ptdp.planner.inputs.plan_flags import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, add_plan_arguments
from ptdp.planner.request import PlanRequest, prepare
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, MOE_FIT_FIELDS, PerfConstants
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.planner.validate.published import source_key

#: Where :func:`default_moe_csv` looks: the repository's benchmarks/data folder.
MOE_CSV = Path(__file__).resolve().parents[4] / "benchmarks" / "data" / "published_moe_validation.csv"
UNITS = ("tokens/s per GPU", "s per step")


def default_moe_csv() -> Path | None:
    """``benchmarks/data/published_moe_validation.csv`` of this checkout, or None if absent."""
    return MOE_CSV if MOE_CSV.is_file() else None


#: The MoE table's columns: the run's flags and result, and what describes its source
MOE_COLUMNS = (
    *("source", "url", "model", "preset", "gpu_type", "gpus", "precision", "seq_len", "global_batch"),
    *("micro_batch", "tp", "cp", "pp", "vpp", "ep", "etp", "sequence_parallel", "sharding", "recompute"),
    *("recompute_modules", "dispatcher", "mtp_layers", "moe_overlap", "dp_overlap", "tp_overlap"),
    *("pp_overlap", "cuda_graph_impl", "cuda_graph_scope", "split_accounting", "reported", "reported_unit"),
    *("flop_convention", "assumed", "notes"),
)


def unread_columns(path: str | Path) -> list[str]:
    """The header's names that are not :data:`MOE_COLUMNS` (a misspelt column is not read)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return [name for name in header if name.strip() not in MOE_COLUMNS]


def is_moe_table(path: str | Path) -> bool:
    """The file's header has the MoE table's ``ep`` and ``preset`` columns."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return "ep" in header and "preset" in header


@dataclass(frozen=True)
class MoERun:
    """One published MoE run: ``options`` the ``ptdp plan`` flags (by destination) that plan its
    published layout, ``step_time`` the seconds per step it reports or implies, ``source`` and
    ``url`` where it is published, ``assumed`` what the source leaves open."""

    name: str
    source: str
    url: str
    options: tuple[tuple[str, object], ...]
    step_time: float
    assumed: str

    @property
    def source_key(self) -> str:
        """The publisher (:func:`~ptdp.planner.validate.published.source_key`)."""
        return source_key(self.url, self.source)

    def flags(self) -> str:
        """The ``ptdp plan`` command line of the run."""
        out = []
        for dest, value in self.options:
            flag = "--" + dest.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is False:
                out.append("--no-" + flag[2:])
            elif isinstance(value, list) and dest == "pipeline_layer_split":  # one comma list
                out.append(f"{flag} {','.join(map(str, value))}")
            elif isinstance(value, list):
                out.append(f"{flag} {' '.join(map(str, value))}")
            else:
                out.append(f"{flag} {value}")
        return " ".join(out)


def _yes(text: str, column: str) -> bool:
    value = text.strip().lower()
    if value not in ("y", "n", ""):
        raise ValueError(f"{column}={text!r} must be y or n")
    return value == "y"


def _positive(r: dict, column: str) -> int:
    """A column's positive integer; ValueError naming the column otherwise."""
    try:
        value = int(r[column])
    except (TypeError, ValueError):
        raise ValueError(f"{column}={r[column]!r} must be a positive integer") from None
    if value < 1:
        raise ValueError(f"{column}={value} must be a positive integer")
    return value


def _options(r: dict) -> dict[str, object]:
    """``ptdp plan``'s flags (by destination) for the row's model, cluster and published layout."""
    missing = [column for column, value in r.items() if value is None]
    if missing or None in r:
        raise ValueError(f"the row has {'too few' if missing else 'too many'} columns for the header")
    for column in ("gpus", "seq_len", "global_batch", "micro_batch", "tp", "cp", "pp", "vpp", "ep", "etp"):
        _positive(r, column)
    if r["precision"].strip() not in ("bf16", "fp8"):
        raise ValueError(f"precision={r['precision']!r} must be bf16 or fp8")
    unknown = set(r.get("split_accounting", "").split()) - {"embedding", "loss"}
    if unknown:
        raise ValueError(f"split_accounting={r['split_accounting']!r}: embedding and/or loss, not {sorted(unknown)}")
    preset = r["preset"].strip().lower()
    if preset not in MOE_PRESETS:
        raise ValueError(f"preset={preset!r} is not a mixture-of-experts preset ({', '.join(MOE_PRESETS)})")
    gpu = r["gpu_type"].strip().lower()
    if gpu not in CATALOG:
        raise ValueError(f"gpu_type={gpu!r} is not in the GPU catalog")
    o: dict[str, object] = {
        "model": preset,
        "gpu": gpu,
        "gpus": int(r["gpus"]),
        "seq_length": int(r["seq_len"]),
        "global_batch_size": int(r["global_batch"]),
        "micro_batch_size": int(r["micro_batch"]),
        "tensor_model_parallel_size": int(r["tp"]),
        "context_parallel_size": int(r["cp"]),
        "pipeline_model_parallel_size": int(r["pp"]),
        "expert_model_parallel_size": int(r["ep"]),
        "expert_tensor_parallel_size": int(r["etp"]),
        "sequence_parallel": _yes(r["sequence_parallel"], "sequence_parallel"),
        "data_parallel_sharding_strategy": r["sharding"].strip(),
        "recompute_granularity": r["recompute"].strip(),
        "mtp_num_layers": int(r["mtp_layers"] or 0),
    }
    dispatcher = r["dispatcher"].strip()
    if dispatcher in ("deepep", "hybridep"):
        o["moe_flex_dispatcher_backend"] = dispatcher
    else:
        o["moe_token_dispatcher_type"] = dispatcher
    if int(r["vpp"]) > 1:
        o["virtual_pipeline_model_parallel_size"] = int(r["vpp"])
    if int(r["pp"]) > 1:  # Megatron-Core's schedule, not a zero-bubble one the search would prefer
        o["pipeline_schedule"] = "interleaved-1f1b" if int(r["vpp"]) > 1 else "1f1b"
    if r["recompute_modules"].strip():
        o["recompute_modules"] = r["recompute_modules"].split()
    if r["precision"].strip() == "fp8":
        o["fp8"] = True
    for column, dest in (
        ("tp_overlap", "tp_comm_overlap"),
        ("pp_overlap", "overlap_p2p_communication"),
        ("moe_overlap", "overlap_moe_expert_parallel_comm"),
    ):
        if _yes(r[column], column):
            o[dest] = True
    if not _yes(r["dp_overlap"], "dp_overlap"):
        o["overlap_grad_reduce"] = False
    impl, scope = (r.get("cuda_graph_impl") or "").strip(), (r.get("cuda_graph_scope") or "").split()
    if impl not in ("", *CUDA_GRAPH_IMPLS):
        raise ValueError(f"cuda_graph_impl={impl!r} must be empty or one of {', '.join(CUDA_GRAPH_IMPLS)}")
    unknown_scopes = sorted(set(scope) - set(CUDA_GRAPH_SCOPES))
    if unknown_scopes:
        raise ValueError(
            f"cuda_graph_scope={r['cuda_graph_scope']!r}: {unknown_scopes} not in {', '.join(CUDA_GRAPH_SCOPES)}"
        )
    if impl:
        o["cuda_graph_impl"] = impl
    if scope:
        o["cuda_graph_scope"] = scope
    counted = r.get("split_accounting", "").split()
    layers = with_mtp(MOE_PRESETS[preset], int(r["mtp_layers"] or 0)).num_layers
    pp = int(r["pp"])
    if not counted and int(r["vpp"]) == 1 and pp > 1 and layers % pp == 0:  # Megatron's even split
        o["pipeline_layer_split"] = [layers // pp] * pp
    if "embedding" in counted:
        o["account_for_embedding_in_pipeline_split"] = True
    if "loss" in counted:
        o["account_for_loss_in_pipeline_split"] = True
    return o


def _run(r: dict) -> MoERun:
    options = _options(r)
    unit, reported = r["reported_unit"].strip(), float(r["reported"])
    if unit not in UNITS or not (reported > 0 and math.isfinite(reported)):
        raise ValueError(f"reported={r['reported']} {unit!r}: a positive number in one of {UNITS}")
    tokens = int(r["global_batch"]) * int(r["seq_len"])
    step = reported if unit == UNITS[1] else tokens / (reported * int(r["gpus"]))
    return MoERun(r["model"], r["source"], r["url"].strip(), tuple(options.items()), step, r["assumed"].strip())


def load_moe_runs(path: str | Path) -> list[MoERun]:
    """Parse the MoE validation table, each row's flags checked as ``ptdp plan`` checks them.
    Raises ValueError naming the line for a bad row, and for a column named twice."""
    runs = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        twice = sorted({name for name in header if header.count(name) > 1})
        if twice:
            raise ValueError(f"{path}: column {', '.join(map(repr, twice))} named twice in the header")
        for r in reader:
            try:
                run = _run(r)
                run_request(run)
            except (KeyError, ValueError, ConfigError) as e:
                raise ValueError(f"{path}:{reader.line_num}: {e}") from None
            runs.append(run)
    return runs


def run_request(run: MoERun, constants: PerfConstants | None = None) -> PlanRequest:
    """The checked ``ptdp plan`` request of ``run`` (its flags, as the command line gives them);
    ``constants``: its fitted constants (:func:`with_fitted`) replace the defaults."""
    parser = RaisingParser(prog="ptdp plan", add_help=False)
    add_plan_arguments(parser)
    request = prepare(keyword_namespace(parser, dict(run.options), caller="ptdp plan --validate"))
    if constants is not None:
        request.constants = with_fitted(request.constants, constants)
    return request


def with_fitted(target: PerfConstants, fitted: PerfConstants) -> PerfConstants:
    """``target`` (a request's constants, with its run's overlap) with the fitted constants of
    ``fitted``: the plain MoE ones, ``moe_arch_fits`` and ``arch_fits``."""
    names = (*MOE_FIT_FIELDS, "moe_arch_fits", "arch_fits")
    return dataclasses.replace(target, **{name: getattr(fitted, name) for name in names})


def run_arch(run: MoERun) -> str:
    """The architecture of ``run``'s GPU (whose fitted constants plan it)."""
    return CATALOG[str(dict(run.options)["gpu"])].arch


def predict_run(run: MoERun, constants: PerfConstants | None = None) -> Plan | None:
    """The planner's best plan of ``run``'s published layout (what ``ptdp plan`` prints first with
    its flags); when none fits, the one closest to fitting that only memory rejected, timed all the
    same (``fits`` False: the run happened, :func:`memory_checks` reports the miss); None when the
    rules reject them all."""
    return published_plan(run_request(run, constants))


def published_plan(request: PlanRequest) -> Plan | None:
    """:func:`predict_run` of a prepared request."""
    result = request.search()
    if result.plans:
        return result.plans[0]
    over = [plan for plan, v in result.rejected if v.rule == "memory" and plan.memory is not None]
    if not over:
        return None
    closest = min(over, key=lambda plan: plan.need_memory().total)
    perf = evaluate_performance(request.model, closest.layout, request.cluster, request.constants)
    return Plan(closest.layout, False, closest.memory, perf.time, perf.tflops_per_gpu / TFLOPS, perf.mfu)


def moe_errors(runs: list[MoERun], constants: PerfConstants | None = None) -> list[tuple[MoERun, Plan, float]]:
    """(run, plan, relative step-time error) of each run (``constants``: the MoE constants to use;
    default the planner's). Raises ValueError naming a run whose layout breaks a rule."""
    out = []
    for run in runs:
        plan = predict_run(run, constants)
        if plan is None:
            raise ValueError(f"{run.name} ({run.flags()}): the published layout breaks a rule of ptdp plan")
        out.append((run, plan, plan.need_time().step / run.step_time - 1.0))
    return out


#: The fitted MoE constants (:data:`~ptdp.planner.time.constants.MOE_FIT_FIELDS`) and the grid
#: :func:`fit_moe_constants` searches for each (Hopper, and any architecture without its own grid)
MOE_GRID: dict[str, tuple[float, ...]] = {
    "moe_grouped_gemm_efficiency": (0.9, 1.1, 1.3, 1.5),
    "moe_exchange_efficiency": (0.4, 0.6, 0.8, 1.0),
    "moe_flex_efficiency": (0.6, 0.8, 1.0),
    "moe_layer_overhead": (0.0, 1.5e-3, 3e-3, 4.5e-3),
    "moe_overlap_slowdown": (0.0, 0.25, 0.5),
}
assert tuple(MOE_GRID) == MOE_FIT_FIELDS
#: Grids of the architectures whose fit left :data:`MOE_GRID`: Blackwell's grouped GEMMs and
#: all-to-alls run at lower efficiencies than Hopper's grid holds
MOE_GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "blackwell": {
        "moe_grouped_gemm_efficiency": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.3),
        "moe_exchange_efficiency": (0.1, 0.2, 0.3, 0.4, 0.6, 0.8),
        "moe_flex_efficiency": (0.4, 0.6, 0.8, 1.0, 1.2),
        "moe_layer_overhead": (0.0, 0.75e-3, 1.5e-3, 3e-3, 4.5e-3),
        "moe_overlap_slowdown": (0.0, 0.25, 0.5),
    },
}


def fit_moe_constants(runs: list[MoERun], constants: PerfConstants = DEFAULT_CONSTANTS) -> PerfConstants:
    """``constants`` with, for each architecture of ``runs``' GPUs, the MoE constants of its grid
    (:data:`MOE_GRIDS`, else :data:`MOE_GRID`) that minimise the mean squared log step-time error
    over its runs (:meth:`~ptdp.planner.time.constants.PerfConstants.with_moe_fit`), each at the layout
    :func:`published_plan` picks for it with ``constants`` (runs the rules reject are left out)."""
    out = constants
    for arch in dict.fromkeys(run_arch(run) for run in runs):
        cases = _cases([run for run in runs if run_arch(run) == arch], constants)
        grid = MOE_GRIDS.get(arch, MOE_GRID)
        best = min(
            itertools.product(*grid.values()),
            key=lambda values: _loss(cases, constants.with_moe_fit(arch, dict(zip(grid, values)))),
        )
        out = out.with_moe_fit(arch, dict(zip(grid, best)))
    return out


def _cases(runs: list[MoERun], constants: PerfConstants) -> list[tuple[MoERun, PlanRequest, Candidate]]:
    """(run, request, the layout :func:`published_plan` picks) of the runs the rules accept."""
    out = []
    for run in runs:
        request = run_request(run, constants)
        plan = published_plan(request)
        if plan is not None:
            out.append((run, request, plan.layout))
    return out


def _loss(cases: list[tuple[MoERun, PlanRequest, Candidate]], fitted: PerfConstants) -> float:
    """Mean squared log step-time error of ``cases`` at their layouts with ``fitted``'s constants."""
    total = 0.0
    for run, request, layout in cases:
        perf = evaluate_performance(request.model, layout, request.cluster, with_fitted(request.constants, fitted))
        total += math.log(perf.time.step / run.step_time) ** 2
    return total / max(len(cases), 1)


def moe_log_error(runs: list[MoERun], constants: PerfConstants = DEFAULT_CONSTANTS) -> float:
    """Mean squared log step-time error of ``runs`` planned with ``constants`` (what
    :func:`fit_moe_arch` minimises; runs the rules reject are left out)."""
    return _loss(_cases(runs, constants), constants)


#: The grids of :func:`fit_moe_arch`: ``gemm_peak_fraction`` 0.40-0.80 by 0.02 (the Hopper fit's
#: top), ``hbm_efficiency`` 0.60-1.00 by 0.05, ``gemm_half_dim`` 64, 128 or 256 (half a 128-, 256-
#: or 512-wide tile)
GEMM_GRID = tuple(round(0.40 + 0.02 * i, 2) for i in range(21))
HBM_GRID = tuple(round(0.60 + 0.05 * i, 2) for i in range(9))
HALF_DIM_GRID = (64.0, 128.0, 256.0)


def fit_moe_arch(
    runs: list[MoERun], arch: str, base: PerfConstants = DEFAULT_CONSTANTS, *, rounds: int = 3
) -> tuple[PerfConstants, float]:
    """``arch``'s ``arch_fits`` entry (``gemm_peak_fraction``, ``gemm_half_dim``,
    ``hbm_efficiency`` on :data:`GEMM_GRID`, :data:`HALF_DIM_GRID`, :data:`HBM_GRID`) and its MoE
    constants (:func:`fit_moe_constants`), fitted in turn, ``rounds`` times, on ``runs`` (those on
    its GPUs) by least squares of the log step-time error; the first at the layouts planned with
    ``base``, the second at those planned with the constants reached. Returns the constants and
    :func:`moe_log_error` of them."""
    mine = [run for run in runs if run_arch(run) == arch]
    cases = _cases(mine, base)

    def with_fit(c: PerfConstants, g: float, half_dim: float, e: float) -> PerfConstants:
        others = tuple(fit for fit in c.arch_fits if fit[0] != arch)
        return dataclasses.replace(c, arch_fits=(*others, (arch, g, half_dim, e)))

    best = base
    for _ in range(rounds):
        grid = itertools.product(GEMM_GRID, HALF_DIM_GRID, HBM_GRID)
        best = min((with_fit(best, *point) for point in grid), key=lambda c: _loss(cases, c))
        best = fit_moe_constants(mine, best)
    return best, moe_log_error(mine, best)


def memory_checks(runs: list[MoERun]) -> list[tuple[MoERun, float, float]]:
    """(run, predicted GiB on the most loaded GPU, the GPU's GiB) of each run's published layout,
    as ``ptdp plan`` plans it (the fitting plan, else the closest rejected for memory)."""
    out = []
    for run in runs:
        request = run_request(run)
        result = request.search()
        plans = result.plans or [p for p, v in result.rejected if v.rule == "memory" and p.memory is not None]
        total = min(p.need_memory().total for p in plans) if plans else math.nan
        out.append((run, total / GiB, request.cluster.gpu.memory_bytes / GiB))
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m ptdp.planner.validate.published_moe CSV --fit ARCH``: refit ``ARCH``'s constants
    (:func:`fit_moe_arch`) on the table's runs and print them with the defaults' objective."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[1] != "--fit":
        raise SystemExit("usage: python -m ptdp.planner.validate.published_moe CSV --fit ARCH")
    runs = load_moe_runs(argv[0])
    best, score = fit_moe_arch(runs, argv[2])
    mine = [run for run in runs if run_arch(run) == argv[2]]
    fits = [fit for fit in (*best.arch_fits, *best.moe_arch_fits) if fit[0] == argv[2]]
    print(f"least squares: {fits} mean ln-error^2={score:.6f} (defaults: {moe_log_error(mine):.6f})")


if __name__ == "__main__":
    main()
