"""End-to-end: ``ptdp train`` of a tiny mixture of experts on 4 gloo workers (tp 1, pp 1, dp 4):
2 steps with 4 experts over ep 2 x etp 2 saved, then resumed for a third step with the experts
over ep 4 and the distributed optimizer. The start line names the experts and the grid, each
logged step's metrics line carries the balancing losses and every MoE layer's tokens per expert
over the global batch, the planner report holds the exchanges' timed seconds and the expert load,
and the resumed run starts from the saved iteration."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.cli import run, tiny_flags

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "[0]+[1]"]


def _train(corpus, tmp_path, out, iters: int, grid: list[str]):
    flags = tiny_flags(train_iters=iters, log_interval=1, eval_interval=iters, num_layers=2)
    return run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *flags,
            *MOE,
            "--swiglu",
            "--disable-bias-linear",
            "--nproc-per-node",
            "4",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "4",
            *grid,
            "--data",
            str(corpus / "docs"),
            "--save",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(out),
            "--no-progress",
        ],
        tmp_path,
    )


def test_ptdp_train_a_mixture_of_experts_and_resume_it_at_another_expert_grid(corpus, tmp_path):
    first = _train(corpus, tmp_path, tmp_path / "run1", 2, ["--ep", "2", "--etp", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ptdp train: 4 workers, tp=1 pp=1 dp=4" in first.stdout
    assert "MoE 4 experts, top-2, 1 MoE layers ep=2 etp=2" in first.stdout
    lines = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["iteration"] for line in steps] == [1, 2]
    for line in steps:
        assert line["moe_aux_loss"] > 0 and line["moe_max_load"] >= 1 and line["moe_dropped_fraction"] == 0
        (tokens,) = line["moe_tokens_per_expert"].values()  # layer 1 only; 2 x 2 tokens per sample
        assert list(line["moe_tokens_per_expert"]) == ["1"] and len(tokens) == 4 and sum(tokens) > 0
    # the planner report: the exchanges timed on every rank (no profile in the test's cache: not
    # predicted), the expert load as the steps' mean
    check = json.loads((tmp_path / "run1" / "summary.json").read_text())["planner_check"]
    assert 0 < check["moe_exchange"]["measured_s"] < 10 and "no hardware profile" in check["moe_exchange"]["note"]
    loads = [line["moe_max_rank_load"] for line in steps]
    assert check["expert_load"] == {"predicted": 1.0, "measured": pytest.approx(sum(loads) / 2)}
    assert "    MoE all-to-all per step: " in first.stdout and " ms measured (slowest rank)" in first.stdout
    second = _train(
        corpus,
        tmp_path,
        tmp_path / "run2",
        3,
        ["--ep", "4", "--use-distributed-optimizer", "--load", str(tmp_path / "ckpt")],
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "MoE 4 experts, top-2, 1 MoE layers ep=4" in second.stdout
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["iterations"] == 1 and 0 < summary["final_loss"] < 20  # this run: the third step
    resumed = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in resumed if "loss" in line] == [3]
