"""Invariant 5: the planner's parameter, gradient and optimizer bytes per rank equal what ptdp's
training actually holds, for every tested layout; and the calibration fits."""

from __future__ import annotations

import pytest

from ptdp.run.calibration import fit_gemm_curve, fit_ring
from ptdp.planner.profile import load_profile, save_profile
from ptdp.run.planner_report import compare, format_comparison
from ptdp.planner.flops import gemm_efficiency
from ptdp.planner.hardware import CATALOG
from ptdp.planner.perf import DEFAULT_CONSTANTS
from layout_cases import EXTRA_VARIANT_LAYOUTS, llama_variant, parallel_run, variant_config
from test_layout_equivalence import LAYOUTS


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bytes_per_rank_match_float32(layout):
    results = parallel_run(*layout)
    check = compare(variant_config("float32", *layout), [r["float32"]["measured"] for r in results], None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    assert len(check["ranks"]) == layout[0] * layout[1] * layout[2]
    assert any("bytes equal on every rank: yes" in line for line in format_comparison(check))


@pytest.mark.parametrize("layout", sorted(EXTRA_VARIANT_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bytes_per_rank_match_bfloat16(layout):
    results = parallel_run(*layout)
    check = compare(variant_config("bfloat16", *layout), [r["bfloat16"]["measured"] for r in results], None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    r = check["ranks"][0]["measured"]  # 2 + 4 + 12 bytes per parameter (fp32 grads, main params, moments)
    assert r["params"] * 2 == r["grads"] and r["optimizer"] == 6 * r["params"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bytes_per_rank_match_llama(layout):
    """The Llama-like variant (grouped QKV, SwiGLU, RMSNorm, no linear biases, no position table,
    untied output layer), run in float64: its bytes are exactly twice the planner's float32 ones
    (8 bytes per value instead of 4: parameter, gradient, Adam's two moments)."""
    import dataclasses

    from ptdp.planner.models import spec_from_model_config

    variant = llama_variant(layout[0])
    config = variant_config(variant, *layout)
    spec = spec_from_model_config(config.model)
    assert spec.llama_style and spec.swiglu and not spec.tied and spec.kv_heads == config.model.num_query_groups
    as_float32 = dataclasses.replace(config, model=dataclasses.replace(config.model, params_dtype="float32"))
    measured = []
    for r in parallel_run(*layout):
        m = r[variant]["measured"]
        assert m["params"] == 8 * m["numel"]
        measured.append(dict(m, params=m["params"] // 2, grads=m["grads"] // 2, optimizer=m["optimizer"] // 2))
    check = compare(as_float32, measured, None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]


def test_gemm_and_ring_fits_recover_known_values(tmp_path):
    samples = [{"m": m, "n": n, "k": k, "flops_per_s": 5e10 * gemm_efficiency(m, n, k, peak_fraction=1.0, half_dim=16.0)}
               for m, n, k in [(512, 192, 128), (128, 128, 32), (512, 2048, 128), (64, 64, 64), (1024, 1024, 1024)]]
    peak, half = fit_gemm_curve(samples)
    assert peak == pytest.approx(5e10, rel=0.05) and half == pytest.approx(16.0, rel=0.1)
    g, bw, lat = 4, 2e9, 1e-4
    ring = [(n, 2 * (g - 1) * lat + 2 * (g - 1) / g * n / bw) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22)]
    fit_bw, fit_lat = fit_ring(ring, g)
    assert fit_bw == pytest.approx(bw, rel=1e-6) and fit_lat == pytest.approx(lat, rel=1e-6)
    path = tmp_path / "profile.json"
    save_profile(path, CATALOG["a100-80gb"], DEFAULT_CONSTANTS, {"x": 1})
    assert load_profile(path) == (CATALOG["a100-80gb"], DEFAULT_CONSTANTS)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a hardware profile"):
        load_profile(tmp_path / "bad.json")


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 2, 2)], ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_distributed_optimizer_state_is_one_dp_th(layout):
    """Optimizer bytes per rank = unsharded / dp (12 bytes per parameter for bf16: fp32 main
    parameters and Adam's moments), up to bucket padding, and equal to the planner's numbers."""
    from layout_cases import DP_LAYOUTS

    assert layout in DP_LAYOUTS
    results = parallel_run(*layout)
    config = variant_config("dp_distopt_bf16", *layout)
    measured = [r["dp_distopt_bf16"]["measured"] for r in results]
    check = compare(config, measured, None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    dp = layout[2]
    for row in check["ranks"]:
        n, pad = row["predicted"]["numel"], row["padding_elements"]
        assert row["measured"]["optimizer"] == (n + pad) * 12 // dp
        assert 0 <= pad < 4 * dp  # a few buckets, each padded to a multiple of dp


def test_linear_fit_and_core_sharing_model():
    from ptdp.run.calibration import fit_linear
    from ptdp.planner.perf import core_shared_step

    bw, lat = 1.5e9, 3e-4
    fit_bw, fit_lat = fit_linear([(n, lat + n / bw) for n in (1 << 12, 1 << 18, 1 << 22)])
    assert fit_bw == pytest.approx(bw, rel=1e-6) and fit_lat == pytest.approx(lat, rel=1e-6)
    # 8 workers on 2 cores, two stages: 4 workers of each stage; total busy / cores
    assert core_shared_step([0.1, 0.0, 0.3], 2, 8, 2) == pytest.approx(4 * (0.1 + 0.3) / 2)
    assert core_shared_step([0.1, 0.2, 0.3], 4, 8, 2) == pytest.approx(2 * (0.1 + 0.2 + 0.2 + 0.3) / 2)
    assert core_shared_step([0.1, 0.2, 0.3], 1, 4, 1) == pytest.approx(4 * 0.3)


def test_shared_cores_bound_the_step_from_below():
    """With more workers than cores the step is at least the machine's total busy time over its
    cores; with a core per worker (or on GPUs) nothing is added."""
    import dataclasses

    from ptdp.planner.hardware import Cluster
    from ptdp.planner.models import ModelSpec
    from ptdp.planner.perf import evaluate_performance
    from ptdp.planner.plan import Layout

    cpu = dataclasses.replace(CATALOG["a100-80gb"], name="local", peak_flops={"fp32": 1.6e11},
                              memory_bandwidth=4e10, nvlink_bandwidth=1.5e9, network_bandwidth=1.5e9, gpus_per_node=8)
    constants = dataclasses.replace(DEFAULT_CONSTANTS, gemm_peak_fraction=1.0, gemm_half_dim=0.0, hbm_efficiency=1.0,
                                    nvlink_efficiency=1.0, nvlink_latency=5e-4, layer_overhead=2e-3, head_overhead=5e-3)
    model = ModelSpec(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=4096)
    layout = Layout(2, 2, 2, 4, 32, precision="fp32")
    alone = evaluate_performance(model, layout, Cluster(cpu, 8, 8), constants)
    shared = evaluate_performance(model, layout, Cluster(dataclasses.replace(cpu, shared_cores=2), 8, 8), constants)
    assert alone.time.core_sharing == 0.0
    assert shared.time.core_sharing > 0.0
    assert shared.step_time == pytest.approx(alone.step_time + shared.time.core_sharing)
    no_overhead = evaluate_performance(model, layout, Cluster(cpu, 8, 8),
                                       dataclasses.replace(constants, layer_overhead=0.0, head_overhead=0.0))
    # the last stage's microbatch pays 2 layers' and the head's overhead, m = 4 times
    assert alone.time.compute - no_overhead.time.compute == pytest.approx(4 * (2 * 2e-3 + 5e-3))
    plenty = evaluate_performance(model, layout, Cluster(dataclasses.replace(cpu, shared_cores=8), 8, 8), constants)
    assert plenty.time.core_sharing == 0.0


def test_calibration_run_writes_a_usable_profile(tmp_path):
    """``ptdp plan --calibrate``'s workers (4: tp=2 pp=2) measure and write a profile that loads,
    records the shared cores and fits non-negative overheads and a pipeline link."""
    import argparse

    from ptdp.commands.calibrate import run_calibration

    out = tmp_path / "profile.json"
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=None,
                              vocab_size=512, seq_length=16, micro_batch_size=2, global_batch_size=4,
                              tensor_model_parallel_size=2, pipeline_model_parallel_size=2, nproc_per_node=4,
                              precision="fp32", hardware_profile=str(out))
    assert run_calibration(args) == 0
    gpu, constants = load_profile(out)
    import json
    import os

    measured = json.loads(out.read_text())["measurements"]
    assert gpu.shared_cores == len(os.sched_getaffinity(0)) and gpu.gpus_per_node == 4
    assert gpu.peak("fp32") > 1e8 and gpu.nvlink_bandwidth > 0
    assert constants.layer_overhead >= 0.0 and constants.head_overhead >= 0.0
    assert measured["layer_s"] > 0 and measured["head_s"] > 0 and len(measured["p2p"]) == 5
