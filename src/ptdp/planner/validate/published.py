"""The published training runs the planner is checked against, and the FLOP conventions their
sources count in.

``published_runs.csv`` (:func:`load_published_runs`): A100-80GB runs of Megatron SC21 (Narayanan et
al., arXiv:2104.04473) Table 1, TFLOP/s per GPU by eq. 3 (full recompute), and Korthikanti et al.
2022 (arXiv:2205.05198) Table 5, iteration times, with their Figure 1 activation memory in the notes.

``published_runs_h100.csv`` (:func:`load_h100_runs`): H100-era runs, each reporting TFLOP/s per GPU
or MFU under a named FLOP convention, or tokens/s per GPU, turned into the step time it implies
(``step = FLOPs per step / (TFLOP/s per GPU x GPUs)``, MFU x the dense bf16 peak, or
``B s / (tokens/s per GPU x GPUs)``) and compared on seconds. Conventions (no recompute counted):

* ``megatron-2024``: Megatron-LM's ``num_floating_point_operations`` (``megatron/training/training.py``
  at commit f2e5db4, 2024-07-15, the README's H100 tables):
  ``12 B s l h^2 ((1 + g/a + s/h) q/h + f/h x (3/2 with SwiGLU) + V/(2 l h))``, ``q = a d``, ``g``
  key/value groups, ``f`` the MLP width, ``V`` padded; full ``s x s`` attention.
* ``palm``: PaLM (Chowdhery et al. 2022, arXiv:2204.02311, App. B), the Llama 3 paper's MFU:
  ``(6 N + 12 l h s)`` per token, ``N`` every parameter.

Columns beyond shape and layout: ``cp_comm_type``, ``sharding`` (Megatron's strategy),
``dp_overlap`` / ``tp_overlap`` / ``pp_overlap`` (y: overlapped with compute; ``tp_overlap`` async:
PyTorch's asynchronous TP, ``--enable-async-tensor-parallel``, y: Transformer Engine's), ``layer_split``
(space-separated; empty: even), ``assumed`` (settings the source does not state, explained in ``notes``);
optional ``grad_reduce`` (fp32, the default, or bf16: ``--grad-reduce-in-bf16``) and
``fp8_param_gather`` (y: FP8 weights, ``--fp8-param-gather``).
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ptdp.config.model import ModelConfig
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, UnknownGPUError, get_gpu
from ptdp.planner.inputs.models import gpt, llama
from ptdp.planner.inputs.plan_flags import CP_IMPLEMENTATIONS
from ptdp.planner.memory.params import stage_param_counts

#: Where :func:`default_csv` looks after $PTDP_PUBLISHED_RUNS: the repository's
#: ``benchmarks/data/published_runs.csv``.
CSV_CANDIDATES = (Path(__file__).resolve().parents[4] / "benchmarks" / "data" / "published_runs.csv",)


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
    model: ModelConfig
    layout: Candidate
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


def _catalog_gpu(text: str, where: str) -> str:
    """The catalog key of a row's ``gpu_type`` (:func:`~ptdp.planner.inputs.hardware.get_gpu`'s
    check); ValueError naming ``where`` if unknown."""
    key = text.strip().lower()
    try:
        get_gpu(key)
    except UnknownGPUError as e:
        raise ValueError(f"{where}: {e}") from None
    return key


def load_published_runs(path: str | Path) -> list[PublishedRun]:
    """Parse the CSV: model shape, layout (tp, pp, dp, vpp, micro/global batch, sp, recompute),
    GPU, and reported TFLOP/s, iteration time (notes: "iteration time X s") and Figure 1 memory
    (notes: "params+opt X; act Y none / Z seq+sel")."""
    runs = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, r in enumerate(csv.DictReader(f), start=2):
            ffn = int(r["ffn_hidden"]) if r["ffn_hidden"].strip() else None
            model = gpt(
                int(r["layers"]),
                int(r["hidden"]),
                int(r["heads"]),
                ffn_hidden_size=ffn,
                vocab_size=int(r["vocab"]),
                seq_length=int(r["seq_len"]),
            )
            layout = Candidate.of(
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
            gpu = _catalog_gpu(r["gpu_type"], f"{path}:{line}")
            tflops = _float(r["reported_tflops_per_gpu"])
            if tflops is not None and not tflops > 0:
                raise ValueError(f"{path}:{line}: reported_tflops_per_gpu={tflops} must be a positive number")
            runs.append(
                PublishedRun(
                    source=r["source"].split(" (")[0],
                    name=r["model"],
                    model=model,
                    layout=layout,
                    gpu=gpu,
                    reported_tflops=tflops,
                    reported_iteration_time=_search(r"iteration time ([0-9.]+) s", notes),
                    reported_params_opt_gib=_search(r"params\+opt ([0-9.]+)", notes),
                    reported_act_none_gib=_search(r"act ([0-9.]+) none", notes),
                    reported_act_seqsel_gib=_search(r"/ ([0-9.]+) seq\+sel", notes),
                )
            )
    return runs


CONVENTIONS = ("megatron-2024", "palm", "tokens")
UNITS = ("model TFLOP/s per GPU", "MFU %", "tokens/s per GPU")

#: Where :func:`default_h100_csv` looks: the repository's benchmarks/data folder.
H100_CSV = Path(__file__).resolve().parents[4] / "benchmarks" / "data" / "published_runs_h100.csv"


def default_h100_csv() -> Path | None:
    """``benchmarks/data/published_runs_h100.csv`` of this checkout, or None if absent."""
    return H100_CSV if H100_CSV.is_file() else None


@dataclass(frozen=True)
class H100Run:
    """One row of ``published_runs_h100.csv`` as planner objects.

    Attributes:
        name, source: model label and source (document, table, URL).
        model, layout, gpu: what the planner evaluates (``gpu`` a catalog key).
        reported: the figure as published, in ``unit`` (:data:`UNITS`) under ``convention``.
        step_time: seconds per step that figure implies (:func:`reported_step_time`).
        dp_overlap, tp_overlap: the run overlapped its data-/tensor-parallel communication
            (``tp_overlap``: Transformer Engine's, ``--tp-comm-overlap``).
        async_tp: the run used PyTorch's asynchronous TP (column ``tp_overlap`` = async).
        pp_overlap: the run overlapped its pipeline transfers with compute (column ``pp_overlap``;
            absent: no), :attr:`ptdp.planner.time.constants.PerfConstants.pp_overlap`.
        assumed: settings the source does not state.
        url: where the source is published; :attr:`source_key` groups runs by it.
        cp_implementation: the context-parallel implementation (column ``cp_implementation``: te,
            the default, or torch), :attr:`ptdp.planner.time.constants.PerfConstants.cp_implementation`.
    """

    name: str
    source: str
    model: ModelConfig
    layout: Candidate
    gpu: str
    reported: float
    unit: str
    convention: str
    step_time: float
    dp_overlap: bool
    tp_overlap: bool
    assumed: str
    pp_overlap: bool = False
    url: str = ""
    async_tp: bool = False
    cp_implementation: str = "te"

    @property
    def source_key(self) -> str:
        """The publisher a run comes from (:func:`source_key`)."""
        return source_key(self.url, self.source)


def source_key(url: str, source: str) -> str:
    """One name per publisher, for leave-one-source-out: ``owner/repo`` of a GitHub URL, the arXiv
    id of a paper, else the source text up to its first comma."""
    found = re.search(r"github\.com/([^/]+/[^/#?]+)", url) or re.search(r"arxiv\.org/abs/([0-9.]+)", url)
    return found.group(1) if found else source.split(",")[0].strip()


def megatron_2024_flops(model: ModelConfig, global_batch_size: int, *, divisible_by: int = 128, tp: int = 1) -> float:
    """FLOPs of one step by Megatron-LM's ``num_floating_point_operations`` (commit f2e5db4)."""
    b, s, l, h, a = global_batch_size, model.seq_length, model.num_layers, model.hidden_size, model.num_attention_heads
    q = model.head_dim * a
    v_pad = padded_vocab_size(model.vocab_size, divisible_by, tp)
    gated = 1.5 if model.swiglu else 1.0
    return (
        12.0
        * b
        * s
        * l
        * h
        * h
        * ((1 + model.kv_heads / a + s / h) * q / h + model.ffn / h * gated + v_pad / (2 * l * h))
    )


def palm_flops(model: ModelConfig, global_batch_size: int) -> float:
    """FLOPs of one step by PaLM App. B: ``(6 N + 12 l h s) B s``, N every parameter (exact count)."""
    n_params = sum(stage_param_counts(model, 1, 1))
    s = model.seq_length
    return (6.0 * n_params + 12.0 * model.num_layers * model.hidden_size * s) * global_batch_size * s


def reported_step_time(
    model: ModelConfig, layout: Candidate, gpu: str, reported: float, unit: str, convention: str
) -> float:
    """Seconds per step implied by a reported TFLOP/s per GPU or MFU (%) under ``convention``, or
    by tokens/s per GPU. MFU uses the catalog's dense bf16 peak (989.5 TFLOP/s on H100 SXM and H200,
    the figure the sources divide by). Raises ValueError for an unknown unit or convention.
    """
    if unit not in UNITS or convention not in CONVENTIONS or (unit == UNITS[2]) != (convention == "tokens"):
        raise ValueError(
            f"unit {unit!r} / convention {convention!r}: expected one of {UNITS} / {CONVENTIONS} "
            f"(tokens/s per GPU goes with the convention tokens)"
        )
    if unit == UNITS[2]:
        return layout.global_batch_size * model.seq_length / (reported * layout.num_gpus)
    tflops = reported * 1e12 if unit == UNITS[0] else reported / 100.0 * CATALOG[gpu].peak("bf16")
    count = (
        megatron_2024_flops(model, layout.global_batch_size, tp=layout.tp)
        if convention == "megatron-2024"
        else palm_flops(model, layout.global_batch_size)
    )
    return count / (tflops * layout.num_gpus)


def _yes(text: str, column: str) -> bool:
    """A y/n cell of ``column`` (empty: n); ValueError naming the column for another value."""
    value = text.strip().lower()
    if value not in ("y", "yes", "true", "1", "n", "no", "false", "0", ""):
        raise ValueError(f"{column}={text!r} must be y or n")
    return value in ("y", "yes", "true", "1")


def _model(r: dict) -> ModelConfig:
    shape = [int(r[k]) for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len")]
    untied, flash = not _yes(r["tied"], "tied"), _yes(r["flash_attention"], "flash_attention")
    repeated = _flag(r.get("kv_repeated") or "", "kv_repeated") or None
    if r["mlp"].strip() == "swiglu":
        return llama(*shape, untie_embeddings_and_output_weights=untied, use_flash_attn=flash, kv_repeated=repeated)
    layers, hidden, heads, kv, ffn, vocab, seq = shape
    return gpt(
        layers,
        hidden,
        heads,
        num_query_groups=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq,
        untie_embeddings_and_output_weights=untied,
        use_flash_attn=flash,
        kv_repeated=repeated,
    )


def _tp_overlap(text: str) -> tuple[bool, bool]:
    """Column ``tp_overlap``: (Transformer Engine's overlap, PyTorch's async TP) from y / n / async."""
    value = text.strip().lower()
    if value not in ("y", "yes", "n", "no", "", "async"):
        raise ValueError(f"tp_overlap={text!r} must be y, n or async")
    return value in ("y", "yes"), value == "async"


def _grad_reduce_in_bf16(text: str) -> bool:
    """Column ``grad_reduce`` (optional): fp32 (default) or bf16 (``--grad-reduce-in-bf16``)."""
    value = text.strip() or "fp32"
    if value not in ("fp32", "bf16"):
        raise ValueError(f"grad_reduce={value!r} must be fp32 or bf16")
    return value == "bf16"


def _flag(text: str, column: str) -> bool:
    """An optional y/n column (empty: n); ValueError for another value."""
    value = text.strip().lower()
    if value not in ("", "y", "n", "yes", "no"):
        raise ValueError(f"{column}={text!r} must be y or n")
    return value in ("y", "yes")


def _layout(r: dict) -> Candidate:
    split = tuple(int(x) for x in r["layer_split"].split()) or None
    precision = r["precision"].strip()
    bf16_grads = _grad_reduce_in_bf16(r.get("grad_reduce") or "")
    fp8_params = _flag(r.get("fp8_param_gather") or "", "fp8_param_gather")
    if bf16_grads and precision not in ("bf16", "fp8"):
        raise ValueError(f"grad_reduce=bf16 needs bf16 parameters (precision bf16 or fp8), not {precision}")
    if fp8_params and precision != "fp8":
        raise ValueError(f"fp8_param_gather=y needs precision fp8, not {precision}")
    cp = int(r["cp"])
    cp_comm_type = (r["cp_comm_type"].strip() or "p2p") if cp > 1 else "p2p"
    return Candidate.of(
        tp=int(r["tp"]),
        pp=int(r["pp"]),
        dp=int(r["dp"]),
        micro_batch_size=int(r["micro_batch"]),
        global_batch_size=int(r["global_batch"]),
        virtual_stages=int(r["vpp"]),
        recompute=r["recompute"].strip(),
        sequence_parallel=_yes(r["sequence_parallel"], "sequence_parallel"),
        sharding=r["sharding"].strip(),
        precision=precision,
        layer_split=split,
        cp=max(cp, 1),
        cp_comm_type=cp_comm_type,
        grad_reduce_in_bf16=bf16_grads,
        fp8_param_gather=fp8_params,
    )


def load_h100_runs(path: str | Path) -> list[H100Run]:
    """Parse ``published_runs_h100.csv``; checks that ``gpus`` equals the layout's GPU count.

    Raises KeyError for a missing column, ValueError for a bad or non-positive number, an unknown
    GPU, unit or convention, or a ``gpus`` column that disagrees with ``tp * cp * pp * dp``.
    """
    runs = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for r in reader:
            line = reader.line_num  # the row's last physical line (a notes cell may span several)
            try:
                layout = _layout(r)
                tp_overlap, async_tp = _tp_overlap(r["tp_overlap"])
                if (tp_overlap or async_tp) and not (layout.parallel.sequence_parallel and layout.tp > 1):
                    raise ValueError(
                        f"tp_overlap={r['tp_overlap'].strip()} needs sequence_parallel=y and tp > 1 (it "
                        "overlaps the sequence-parallel all-gather and reduce-scatter)"
                    )
                if layout.num_microbatches < 1 or layout.global_batch_size % (layout.micro_batch_size * layout.dp):
                    raise ValueError(
                        f"global_batch={layout.global_batch_size} is not a multiple of micro_batch x dp = "
                        f"{layout.micro_batch_size} x {layout.dp}"
                    )
                model = _model(r)
                gpus, reported = int(r["gpus"]), float(r["reported"])
                cp_implementation = (r.get("cp_implementation") or "").strip() or "te"
                if cp_implementation not in CP_IMPLEMENTATIONS:
                    raise ValueError(
                        f"cp_implementation={cp_implementation!r} must be one of {', '.join(CP_IMPLEMENTATIONS)}"
                    )
                dp_overlap, pp_overlap = (
                    _yes(r["dp_overlap"], "dp_overlap"),
                    _yes(r.get("pp_overlap") or "", "pp_overlap"),
                )
            except ValueError as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            gpu = _catalog_gpu(r["gpu_type"], f"{path}:{line}")
            if layout.num_gpus != gpus:
                raise ValueError(f"{path}:{line}: gpus={r['gpus']} but tp*cp*pp*dp = {layout.num_gpus}")
            unit, convention = r["reported_unit"].strip(), r["flop_convention"].strip()
            if not reported > 0:
                raise ValueError(f"{path}:{line}: reported={r['reported']} must be a positive number")
            runs.append(
                H100Run(
                    name=r["model"],
                    source=r["source"],
                    model=model,
                    layout=layout,
                    gpu=gpu,
                    reported=reported,
                    unit=unit,
                    convention=convention,
                    step_time=reported_step_time(model, layout, gpu, reported, unit, convention),
                    dp_overlap=dp_overlap,
                    tp_overlap=tp_overlap,
                    async_tp=async_tp,
                    assumed=r["assumed"].strip(),
                    pp_overlap=pp_overlap,
                    url=(r.get("url") or "").strip(),
                    cp_implementation=cp_implementation,
                )
            )
    return runs
