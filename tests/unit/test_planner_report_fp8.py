"""ptdp train's report of an FP8 run (``--fp8-format``): the planner's FP8 model of the run's recipe,
the FP8 bytes it predicts (weight copies, activations) and its step time."""

from __future__ import annotations

import dataclasses

import pytest

import ptdp
from ptdp.planner.candidate import run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.fp8 import FP8_WEIGHT_COPY_BYTES, layer_fp8_weights
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.profile import save_profile
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.run.planner_report import compare, format_comparison

PER_RANK = [
    {"coords": (t, 0, 0), "numel": 0, "params": 0, "grads": 0, "optimizer": 0, "peak": 2**30, "peak_kind": "rss"}
    for t in range(2)
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_fp8_runs_report_names_its_recipe_and_fp8_bytes(tmp_path, dtype):
    fp8 = dict(fp8_format="hybrid", fp8_recipe="tensorwise")
    config = ptdp.load_config(world_size=2, tp=2, pp=1, params_dtype=dtype, sequence_parallel=True, **fp8)
    plain = ptdp.load_config(world_size=2, tp=2, pp=1, params_dtype=dtype, sequence_parallel=True)
    gpu = dataclasses.replace(CATALOG["h100-sxm"], peak_flops={"bf16": 1e14, "fp32": 5e13})  # no FP8 peak
    profile = tmp_path / "profile.json"
    save_profile(profile, gpu, DEFAULT_CONSTANTS, {})
    check = compare(config, PER_RANK, 1.0, profile)
    m = config.model
    layers = config.pipeline.stage_layers[0]
    activations = rank_activation_bytes(m, run_candidate(config), 0, layers, make_vocab_size_divisible_by=128)
    without = rank_activation_bytes(m, run_candidate(plain), 0, layers, make_vocab_size_divisible_by=128)
    copies = FP8_WEIGHT_COPY_BYTES * layers * layer_fp8_weights(m, 2)
    assert check["fp8"] == {
        "format": "hybrid",
        "recipe": "tensorwise",
        "stage": 0,
        "predicted_weight_copy_bytes": copies,
        "predicted_activation_bytes": activations,
        "predicted_activation_bytes_without_fp8": without,
    }
    assert activations < without
    # the predicted peak holds them; the step time is the FP8 model's (emulated without an FP8 peak)
    reference = compare(plain, PER_RANK, 1.0, profile)
    peak = check["peak_memory"]["predicted_bytes"] - reference["peak_memory"]["predicted_bytes"]
    assert peak == pytest.approx(copies + activations - without, rel=1e-9)
    step = evaluate_performance(
        m,
        run_candidate(config),
        Cluster(gpu, 2, 2),
        DEFAULT_CONSTANTS.with_overlap(overlap_grad_reduce=config.parallel.overlap_grad_reduce),
    )
    assert check["step_time"]["predicted_s"] == pytest.approx(step.time.step, rel=1e-12)
    assert check["step_time"]["predicted_s"] > reference["step_time"]["predicted_s"]
    line = next(line for line in format_comparison(check) if "FP8" in line)
    assert line.startswith("    FP8 (hybrid, tensorwise recipe), stage 0: ")
    assert f"{copies / 2**20:,.1f} MiB FP8 weight copies + {activations / 2**20:,.1f} MiB activations" in line
    assert "fp8" not in reference


def test_an_moe_fp8_pipeline_runs_report_has_its_fp8_and_bubble_lines():
    """An MoE run reports its FP8 bytes (the planned MoE model's) and its schedule's bubble too."""
    config = ptdp.load_config(
        world_size=2, tp=1, pp=2, pipeline_schedule="zb-h1", micro_batch_size=1, global_batch_size=4,
        params_dtype="bfloat16", num_experts=4, moe_router_topk=2, fp8_format="hybrid", fp8_recipe="rowwise",
    )  # fmt: skip
    ranks = [dict(PER_RANK[0], coords=(0, 0, r)) for r in range(2)]
    check = compare(config, ranks, None, None)
    assert check["fp8"]["recipe"] == "rowwise" and check["fp8"]["predicted_weight_copy_bytes"] > 0
    assert check["pipeline"]["schedule"] == "zb-h1"
    lines = format_comparison(check)
    assert any(line.startswith("    FP8 (hybrid, rowwise recipe), stage ") for line in lines)
    assert any("zb-h1 schedule: the step idles" in line for line in lines)
