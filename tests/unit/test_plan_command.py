"""``ptdp plan``'s request as the user sees it: the defaults it takes and says, and the notes on
flags that change nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.planner.inputs.models import PRESETS, PUBLISHED_BATCH, preset_name

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


def test_a_presets_published_batch_is_the_default_and_is_said(capsys):
    base = ["plan", "--model", "gpt-1.7b", "--gpus", "8", "--top", "2"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "global batch size 512: gpt-1.7b's published batch, Narayanan et al. SC21, Table 1 "
        "(--global-batch-size to change)"
    )
    assert main([*base, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and {(r["global_batch_size"], r["global_batch_size_source"]) for r in records} == {
        (512, "gpt-1.7b's published batch, Narayanan et al. SC21, Table 1")
    }
    assert main([*base, "--global-batch-size", "64"]) == 0
    assert "global batch size" not in capsys.readouterr().out
    assert main([*base, "--global-batch-size", "64", "--json"]) == 0
    assert not any("global_batch_size_source" in r for r in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "gpt-1.7b", "--num-layers", "12"], "gpt-1.7b's published batch (512) is for its own shape"),
        (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"], "needs --global-batch-size B"),
    ],
)
def test_without_a_published_batch_the_flag_is_named(extra, message, capsys):
    assert main(["plan", "--gpus", "8", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, seq, batch", [("llama3-70b", 8192, 512), ("llama3-8b", 8192, 512)])
def test_a_preset_without_a_published_batch_takes_4m_tokens_per_step(name, seq, batch, capsys):
    assert name in PRESETS and name not in PUBLISHED_BATCH and PRESETS[name].seq_length == seq
    assert main(["plan", "--model", name, "--gpus", "64", "--top", "1", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and {r["global_batch_size"] for r in records} == {batch} and batch == 4 * 2**20 // seq
    assert all(r["global_batch_size_source"].startswith(f"{name} has no published batch: 4M tokens") for r in records)


def test_a_hugging_face_config_needs_the_flag(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8"]) == 2
    assert "ptdp plan needs --global-batch-size B" in capsys.readouterr().err


def test_published_batches_equal_the_validation_tables():
    """The SC21 presets' batches are Table 1's rows of published_runs.csv; Llama 3 405B's is Table 4's."""
    with open(DATA / "published_runs.csv", newline="") as f:
        table1 = [r for r in csv.DictReader(f) if r["source"].startswith("Narayanan")]
    shapes = {(m.num_layers, m.hidden_size, m.num_attention_heads): preset_name(k) for k, m in PRESETS.items()}
    batches = {shapes[int(r["layers"]), int(r["hidden"]), int(r["heads"])]: int(r["global_batch"]) for r in table1}
    assert len(batches) == 10
    assert {name: PUBLISHED_BATCH[name][0] for name in batches} == batches
    with open(DATA / "published_runs_h100.csv", newline="") as f:
        llama = [r for r in csv.DictReader(f) if r["model"] == "Llama 3 405B" and r["seq_len"] == "8192"]
    assert {int(r["global_batch"]) for r in llama} == {PUBLISHED_BATCH["llama3-405b"][0]}


PLAN = ["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64", "--tp", "2", "--pp", "1"]


@pytest.mark.parametrize(
    "extra, note",
    [
        (["--cp", "1", "--cp-comm-type", "all_gather"], "note: --cp-comm-type all_gather changes nothing with --cp 1"),
        (
            ["--recompute-granularity", "selective"],
            "note: --recompute-granularity selective changes nothing with flash",
        ),
    ],
)
def test_flags_that_change_nothing_are_noted(extra, note, capsys):
    assert main([*PLAN, *extra]) == 0
    assert note in capsys.readouterr().out
    assert main(PLAN) == 0
    assert "changes nothing" not in capsys.readouterr().out


def test_selective_recompute_with_flash_attention_is_planned_as_none():
    """What the note says: the same memory and step as no recompute."""
    from ptdp.planner.inputs.hardware import CATALOG, Cluster
    from ptdp.planner.search.layouts import Fixed, search

    cluster = Cluster(CATALOG["h100-sxm"], 8)
    fixed = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        data_parallel_size=4,
        micro_batch_size=1,
        sequence_parallel=True,
        data_parallel_sharding_strategy="optim",
    )
    plans = [
        search(PRESETS["llama2-7b"], cluster, 64, fixed=Fixed(**fixed, recompute_granularity=r)).plans[0]
        for r in ("selective", "none")
    ]
    assert plans[0].need_memory() == plans[1].need_memory() and plans[0].need_time() == plans[1].need_time()


def test_the_layout_found_with_nothing_fixed_is_printed_as_flags_that_plan_it(capsys):
    """With no layout fitting the fixed choices, the best free one is given as flags (no Python
    spellings such as ``layer_split=None``), and those flags plan it."""
    base = ["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch-size", "64", "--top", "1"]
    assert main([*base, "--tp", "1", "--pp", "1", "--micro-batch-size", "64", "--recompute-granularity", "none"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("with nothing fixed"))
    flags = line.split(": ", 1)[1]
    assert flags.startswith("--tp ") and "None" not in out and "True" not in out
    assert main([*base, *flags.split(), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["fits"] and f"--tp {best['tp']} " in flags and f"--pp {best['pp']} " in flags


def test_request_errors_use_the_flags_words(capsys):
    base = ["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch-size", "64"]
    assert main([*base, "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "5"]) == 2
    assert (
        "num_layers=24 is not divisible by pp * num_layers_per_virtual_pipeline_stage = 2*5" in capsys.readouterr().err
    )
    assert (
        main([*base, "--pp", "2", "--pipeline-schedule", "zb-h1", "--virtual-pipeline-model-parallel-size", "2"]) == 2
    )
    assert "needs the interleaved-1f1b schedule, not zb-h1" in capsys.readouterr().err
    assert main([*base, "--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--top", "1"]) == 0
    assert main([*base, "--pp", "4", "--pipeline-layer-split", "12,12"]) == 2
    assert "--pipeline-layer-split 12,12 has 2 stages but --pp 4" in capsys.readouterr().err
    assert main([*base, "--params-dtype", "float64"]) == 2
    assert "--params-dtype float64: the planner models" in capsys.readouterr().err
