"""Leave-one-source-out validation and the memory check of ``ptdp plan --validate``: each source's
runs are predicted by the fit over the other sources only, and every published layout predicted
over its GPU's memory is flagged and counted."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.commands.validate import validation_markdown
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.planner.validate.accuracy import (
    fit_arch,
    fit_constants,
    fitted_runs,
    h100_fit_check,
    h100_label,
    hopper_runs,
    loso_a100,
    loso_h100,
    run_constants,
    validate,
    validate_h100,
)
from ptdp.planner.validate.published import load_h100_runs, load_published_runs, source_key

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
H100, NEW, A100 = (
    DATA / "published_runs_h100.csv",
    DATA / "published_runs_out_of_sample.csv",
    DATA / "published_runs.csv",
)


def test_source_key_names_the_publisher():
    url = "https://github.com/NVIDIA/Megatron-LM/blob/f2e5db4/images/model_table.png"
    assert source_key(url, "Megatron-LM README, model table") == "NVIDIA/Megatron-LM"
    assert source_key("https://arxiv.org/abs/2407.21783", "Llama 3") == "2407.21783"
    assert source_key("", "Some paper, Table 2") == "Some paper"


def test_the_new_tables_come_from_three_sources_the_fit_does_not_use():
    fitted = {run.source_key for run in load_h100_runs(H100)}
    new = {run.source_key for run in load_h100_runs(NEW)}
    assert len(new) >= 3 and not new & fitted
    # torchtitan's H100s are 96 GB parts, planned with their own capacity
    titan = {run.gpu for run in load_h100_runs(NEW) if run.source_key == "pytorch/torchtitan"}
    assert titan == {"h100-96gb", "h200"} and CATALOG["h100-96gb"].memory_bytes > CATALOG["h100-sxm"].memory_bytes


def test_each_source_is_predicted_by_the_fit_over_the_others():
    runs = load_h100_runs(H100) + load_h100_runs(NEW)
    held = loso_h100(runs)
    assert [r.reported for r in held] == [r.reported for r in validate_h100(runs)]
    pool = fitted_runs(hopper_runs(runs))
    for key in ("NVIDIA/Megatron-LM", "pytorch/torchtitan"):
        constants = fit_arch([r for r in pool if r.source_key != key])[0]
        own = [i for i, run in enumerate(runs) if run.source_key == key and run.gpu != "a100-80gb"]
        expected = validate_h100([runs[i] for i in own], constants)
        assert [held[i].predicted for i in own] == pytest.approx([r.predicted for r in expected], rel=1e-12)
    in_sample = validate_h100(runs)
    assert any(abs(a.predicted - b.predicted) > 1e-6 * b.predicted for a, b in zip(held, in_sample))


def test_a100_sources_are_left_out_one_at_a_time():
    runs = load_published_runs(A100)
    held, in_sample = loso_a100(runs), validate(runs)
    assert [(r.name, r.metric) for r in held] == [(r.name, r.metric) for r in in_sample]
    key = runs[0].source
    constants = fit_constants([r for r in runs if r.source != key])[0]
    first = validate([runs[0]], constants)[0]
    assert held[0].predicted == pytest.approx(first.predicted, rel=1e-12)


def test_the_memory_check_flags_and_counts_every_layout_over_its_gpu():
    checks = h100_fit_check(load_h100_runs(H100))
    over = sum(total > cap for _, _, total, cap in checks)
    text = validation_markdown(H100)
    assert text.count("| **no**, ") == over
    assert f"{over} of {len(checks)} published layouts predicted over their GPU's memory." in text


def test_plan_validate_reports_in_sample_and_left_out_errors_per_table_and_together(capsys):
    assert main(["plan", "--validate", str(H100), str(NEW)]) == 0
    out = capsys.readouterr().out
    assert out.count("mean, its source left out") == 3  # each table, then all H100-format tables
    assert "All H100-format tables together" in out
    rows = re.findall(r"^\| step time, bf16 runs \(s\) \| (\d+) \|", out, re.M)
    assert len(rows) == 3 and int(rows[2]) == int(rows[0]) + int(rows[1])


def test_bad_tables_are_refused_naming_the_file(tmp_path, capsys):
    with open(H100, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields, first = reader.fieldnames or [], next(reader)
    empty, zero, reduce = tmp_path / "empty.csv", tmp_path / "zero.csv", tmp_path / "reduce.csv"
    weights, fp16, overlap = tmp_path / "weights.csv", tmp_path / "fp16.csv", tmp_path / "overlap.csv"
    no_sp, cell, flag = tmp_path / "no_sp.csv", tmp_path / "cell.csv", tmp_path / "flag.csv"
    repeated = tmp_path / "repeated.csv"
    fields = [*fields, "kv_repeated"] if "kv_repeated" not in fields else fields
    bf16_row = {**first, "precision": "bf16", "fp8_param_gather": ""}
    for path, rows in (
        (empty, []),
        (zero, [{**first, "reported": "0"}]),
        (reduce, [{**first, "grad_reduce": "fp8"}]),
        (weights, [{**bf16_row, "fp8_param_gather": "maybe"}, {**bf16_row, "fp8_param_gather": "y"}]),
        (fp16, [{**bf16_row, "precision": "fp16", "grad_reduce": "bf16"}]),
        (overlap, [{**first, "tp_overlap": "te"}]),
        (
            no_sp,
            [{**first, "tp": "2", "dp": str(int(first["dp"]) // 2), "tp_overlap": "async", "sequence_parallel": "n"}],
        ),
        (cell, [first, {**first, "reported": "abc"}]),
        (flag, [{**first, "sequence_parallel": "maybe"}]),
        (repeated, [{**first, "kv_repeated": "all"}]),
    ):
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    cases = {
        (str(tmp_path),): "is a folder",
        (str(empty),): "no runs in the table",
        (str(zero),): "reported=0 must be a positive number",
        (str(reduce),): f"--validate {reduce}:2: grad_reduce='fp8' must be fp32 or bf16",
        (str(weights),): f"--validate {weights}:2: fp8_param_gather='maybe' must be y or n",
        (str(fp16),): f"--validate {fp16}:2: grad_reduce=bf16 needs bf16 parameters (precision bf16 or fp8), not fp16",
        (str(overlap),): f"--validate {overlap}:2: tp_overlap='te' must be y, n or async",
        (str(no_sp),): f"--validate {no_sp}:2: tp_overlap=async needs sequence_parallel=y and tp > 1",
        (str(cell),): f"--validate {cell}:3: could not convert string to float: 'abc'",
        (str(flag),): f"--validate {flag}:2: sequence_parallel='maybe' must be y or n",
        (str(repeated),): f"--validate {repeated}:2: kv_repeated='all' must be y or n",
        (str(H100), str(DATA / ".." / "data" / H100.name)): "a table given more than once",
    }
    for tables, message in cases.items():
        assert main(["plan", "--validate", *tables]) == 2
        assert message in capsys.readouterr().err


def test_rows_carry_their_gradient_reduction_and_fp8_weights():
    """NeMo's and Megatron-Bridge's performance runs reduce gradients in bf16 and keep FP8 weights
    (columns grad_reduce and fp8_param_gather, each marked assumed); the others do not."""
    runs = load_h100_runs(H100) + load_h100_runs(NEW)
    nvidia = [r for r in runs if r.source.startswith(("NVIDIA NeMo", "NVIDIA-NeMo Megatron-Bridge"))]
    assert len(nvidia) == 12 and all(r.layout.bf16_grads and "grad_reduce" in r.assumed for r in nvidia)
    assert all(r.layout.fp8_param_gather == (r.layout.precision == "fp8") for r in nvidia)
    others = [r for r in runs if r not in nvidia]
    assert others and not any(r.layout.bf16_grads or r.layout.fp8_param_gather for r in others)


def test_torchtitan_rows_overlap_tp_asynchronously_on_their_500_w_parts():
    """torchtitan's async-TP rows are planned with PyTorch's asynchronous TP (column tp_overlap =
    async), not Transformer Engine's overlap; its H100s at their 500 W limit (h100-96gb)."""
    runs = load_h100_runs(NEW)
    titan = [r for r in runs if r.source_key == "pytorch/torchtitan"]
    assert len([r for r in titan if r.async_tp]) == 9 and not any(r.tp_overlap for r in titan)
    assert all(r.layout.parallel.sequence_parallel for r in titan if r.async_tp)
    assert {CATALOG[r.gpu].power_limit for r in titan if r.gpu.startswith("h100")} == {500.0}
    assert "atp" in h100_label(next(r for r in titan if r.async_tp))


def test_torchtitan_rows_repeat_their_key_value_heads_before_attention():
    """torchtitan's Llama repeats the key/value heads before SDPA (column kv_repeated), so its context
    parallelism exchanges every query head's keys and values: a / kv times the grouped exchange."""
    runs = load_h100_runs(NEW)
    titan = [r for r in runs if r.source_key == "pytorch/torchtitan"]
    assert titan and all(r.model.kv_repeated for r in titan)
    assert not any(r.model.kv_repeated for r in runs if r not in titan)
    cp4 = next(r for r in titan if r.layout.cp == 4 and r.name == "Llama 3 8B")
    cp4 = dataclasses.replace(cp4, cp_implementation="te")  # the exchange alone
    grouped = dataclasses.replace(cp4, model=dataclasses.replace(cp4.model, kv_repeated=None))
    cp_comm = [
        evaluate_performance(
            r.model, r.layout, Cluster(CATALOG[r.gpu], r.layout.num_gpus), run_constants(r)
        ).time.cp_comm
        for r in (cp4, grouped)
    ]
    assert cp_comm[1] > 0
    assert cp_comm[0] == pytest.approx(4 * cp_comm[1], rel=0.01)  # bytes 4 x, the latency terms not


def test_a_single_source_has_no_left_out_error(tmp_path):
    lines = H100.read_text(encoding="utf-8").splitlines()
    one = tmp_path / "one.csv"
    one.write_text("\n".join([lines[0], *[x for x in lines[1:] if "model_table.png" in x]]) + "\n", encoding="utf-8")
    text = validation_markdown(one)
    assert "| n/a |" in text and re.search(r"\| step time, bf16 runs \(s\) \| 9 \| [0-9.]+% \| [0-9.]+% \|\n", text)


def test_each_table_has_its_own_block_under_one_heading(tmp_path):
    part = tmp_path / "part.csv"
    part.write_text("\n".join(A100.read_text(encoding="utf-8").splitlines()[:4]) + "\n", encoding="utf-8")
    doc = tmp_path / "B.md"
    assert main(["plan", "--validate", str(A100), str(part), "--update-benchmarks", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.count("## Planner validation against published runs") == 1
    assert "<!-- begin: ptdp plan --validate -->" in text and "<!-- begin: ptdp plan --validate part.csv -->" in text


def test_one_virtual_stage_is_no_interleaving_and_takes_a_layer_split(capsys):
    args = ["plan", "--model", "llama3-405b", "--gpus", "2048", "--gpu", "h100-sxm", "--tp", "8", "--pp", "16"]
    split = ["--pipeline-layer-split", "7," + "8," * 14 + "7", "--global-batch-size", "2048", "--json"]
    assert main([*args, "--virtual-pipeline-stages", "1", *split]) == 0
    assert {plan["virtual_stages"] for plan in json.loads(capsys.readouterr().out)} == {1}
    assert main([*args, "--virtual-pipeline-stages", "2", *split]) == 2
    assert "cannot be combined with virtual pipeline stages" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--tp", "2", "--json"], "--tensor-model-parallel-size/--tp, --json would be ignored (drop them)"),
        (["--gpu", "h100-sxm"], "--gpu would be ignored (drop it)"),
        (["--plot", "x.png"], "--plot would be ignored"),
        (["--calibrate"], "--calibrate would be ignored"),
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 would be ignored"),
    ],
)
def test_validate_refuses_the_flags_it_would_ignore(capsys, extra, named):
    assert main(["plan", "--validate", str(A100), *extra]) == 2
    err = capsys.readouterr().err
    assert "--validate evaluates each table's runs at their own model, layout and GPU: " + named in err


def test_every_published_layout_fits_under_the_planners_memory():
    """The runs happened, so the planner must not predict any of them over its GPU's memory: every
    layout of the three tables in benchmarks/data, at its own model, GPU and settings."""
    from ptdp.planner.validate.accuracy import fit_check

    checks = fit_check(load_published_runs(A100)) + h100_fit_check(load_h100_runs(H100) + load_h100_runs(NEW))
    assert len(checks) == 18 + 21 + 42
    over = [(name, layout, round(total, 2), round(cap, 2)) for name, layout, total, cap in checks if total > cap]
    assert not over, over
