"""Published A100 training runs: reading ``published_runs.csv``.

The file (see :func:`default_csv`) holds 18 runs on A100-80GB: Megatron SC21 (Narayanan et al.,
arXiv:2104.04473) Table 1, TFLOP/s per GPU counted with eq. 3 (full recompute), and Korthikanti et
al. 2022 (arXiv:2205.05198) Table 5, iteration times with full recompute and with sequence
parallelism + selective recompute, with the activation memory per GPU of their Figure 1 in the
notes. :mod:`ptdp.planner.validate` compares them with the planner's predictions; the H100 table
is :mod:`ptdp.planner.published`.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ptdp.planner.models import ModelSpec
from ptdp.planner.plan import Layout

#: Where :func:`default_csv` looks after $PTDP_PUBLISHED_RUNS: the repository's
#: ``benchmarks/data/published_runs.csv``.
CSV_CANDIDATES = (Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "published_runs.csv",)


def default_csv() -> Path | None:
    """The published-runs file to use, or None if none of the candidate paths exists."""
    env = os.environ.get("PTDP_PUBLISHED_RUNS")
    for path in ([Path(env)] if env else []) + list(CSV_CANDIDATES):
        if path.is_file():
            return path
    return None


@dataclass(frozen=True)
class PublishedRun:
    """One row of the published-runs file, as planner objects plus the reported numbers."""

    source: str
    name: str
    model: ModelSpec
    layout: Layout
    gpu: str
    reported_tflops: float | None
    reported_iteration_time: float | None
    reported_params_opt_gib: float | None
    reported_act_none_gib: float | None
    reported_act_seqsel_gib: float | None


def _float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _search(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else None


def _precision(text: str) -> str:
    return "bf16" if text.startswith("bf16") else "fp16" if "16" in text else "fp32"


def load_published_runs(path: str | Path) -> list[PublishedRun]:
    """Parse the CSV: model shape, layout (tp, pp, dp, vpp, micro/global batch, sp, recompute),
    GPU, and reported TFLOP/s, iteration time (notes: "iteration time X s") and Figure 1 memory
    (notes: "params+opt X; act Y none / Z seq+sel")."""
    runs = []
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            ffn = int(r["ffn_hidden"]) if r["ffn_hidden"].strip() else None
            model = ModelSpec(
                int(r["layers"]),
                int(r["hidden"]),
                int(r["heads"]),
                ffn,
                int(r["vocab"]),
                int(r["seq_len"]),
                name=r["model"],
            )
            layout = Layout(
                tp=int(r["tp"]),
                pp=int(r["pp"]),
                dp=int(r["dp"]),
                micro_batch_size=int(r["micro_batch"]),
                global_batch_size=int(r["global_batch"]),
                virtual_stages=int(r["vpp"]),
                recompute=r["recompute"].strip(),
                sequence_parallel=r["sequence_parallel"].strip() == "y",
                precision=_precision(r["precision"]),
            )
            notes = r["notes"]
            runs.append(
                PublishedRun(
                    source=r["source"].split(" (")[0],
                    name=r["model"],
                    model=model,
                    layout=layout,
                    gpu=r["gpu_type"].lower(),
                    reported_tflops=_float(r["reported_tflops_per_gpu"]),
                    reported_iteration_time=_search(r"iteration time ([0-9.]+) s", notes),
                    reported_params_opt_gib=_search(r"params\+opt ([0-9.]+)", notes),
                    reported_act_none_gib=_search(r"act ([0-9.]+) none", notes),
                    reported_act_seqsel_gib=_search(r"/ ([0-9.]+) seq\+sel", notes),
                )
            )
    return runs
