"""Invariant 5: the planner's parameter, gradient and optimizer bytes per rank equal what ptdp's
training actually holds, for every tested layout; and the calibration fits."""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers.cli import run
from helpers.layout_cases import (
    EXTRA_VARIANT_LAYOUTS,
    LAYOUTS,
    SCHEDULE_LAYOUTS,
    llama_variant,
    parallel_run,
    variant_config,
)
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.time.constants import links_for
from ptdp.planner.time.profile import load_profile
from ptdp.planner.time.profile_fit import fit_exchange_efficiency, fit_grouped_gemm_efficiency
from ptdp.run.planner_report import compare, format_comparison


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

    variant = llama_variant(layout[0])
    config = variant_config(variant, *layout)
    spec = config.model
    assert spec.llama_style and spec.swiglu and not spec.tied and spec.kv_heads == config.model.num_query_groups
    as_float32 = dataclasses.replace(config, model=dataclasses.replace(config.model, params_dtype="float32"))
    measured = []
    for r in parallel_run(*layout):
        m = r[variant]["measured"]
        assert m["params"] == 8 * m["numel"]
        measured.append(dict(m, params=m["params"] // 2, grads=m["grads"] // 2, optimizer=m["optimizer"] // 2))
    check = compare(as_float32, measured, None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 2, 2)], ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_distributed_optimizer_state_is_one_dp_th(layout):
    """Optimizer bytes per rank = unsharded / dp (12 bytes per parameter for bf16: fp32 main
    parameters and Adam's moments), up to bucket padding, and equal to the planner's numbers."""
    from helpers.layout_cases import DP_LAYOUTS

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


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 2, 2)], ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bf16_gradient_buffer_is_half_the_float32_one_as_planned(layout):
    """--grad-reduce-in-bf16: the gradient buffer holds 2 bytes per element (parameters and bucket
    padding), equal to the planner's bytes on every rank."""
    results = parallel_run(*layout)
    check = compare(
        variant_config("dp_bf16_grads", *layout), [r["dp_bf16_grads"]["measured"] for r in results], None, None
    )
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    for row in check["ranks"]:
        n, pad = row["predicted"]["numel"], row["padding_elements"]
        assert row["measured"]["grads"] == 2 * (n + pad) and row["measured"]["params"] == 2 * n


def test_calibration_run_writes_a_usable_profile(tmp_path):
    """``ptdp plan --calibrate``'s workers (4: tp=2 pp=2) measure and write a profile that loads,
    records the shared cores and fits non-negative overheads, a pipeline link and the MoE
    efficiencies (from its all-to-alls and grouped GEMMs). Run as a process within the test's
    budget (the launcher in it has no timeout of its own)."""
    out = tmp_path / "profile.json"
    flags = {"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "vocab-size": 512, "seq-length": 16}
    flags.update({"micro-batch-size": 2, "global-batch-size": 4, "tp": 2, "pp": 2, "nproc-per-node": 4})
    argv = [arg for k, v in flags.items() for arg in (f"--{k}", str(v))]
    cmd = [sys.executable, "-m", "ptdp.cli", "plan", "--calibrate", *argv, "--fp32", "--hardware-profile", str(out)]
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gpu, constants = load_profile(out)
    measured = json.loads(out.read_text())["measurements"]
    assert gpu.shared_cores == len(os.sched_getaffinity(0)) and gpu.gpus_per_node == 4
    assert gpu.peak("fp32") > 1e8 and gpu.nvlink_bandwidth > 0
    assert constants.layer_overhead >= 0.0 and constants.head_overhead >= 0.0
    assert measured["layer_s"] > 0 and measured["head_s"] > 0 and len(measured["p2p"]) == 5
    # the MoE efficiencies: fitted from the 4 workers' all-to-alls and rank 0's grouped GEMMs
    assert [g for g, _, _ in measured["all_to_all"]] == [4] * 5
    assert [(r["experts"], r["grouped"]) for r in measured["grouped_gemm"]] == [(2, True), (8, True), (32, True)]
    links = links_for(Cluster(gpu, 4, 4), constants)
    assert constants.moe_exchange_efficiency == pytest.approx(fit_exchange_efficiency(measured["all_to_all"], links))
    rates = {"peak_flops": gpu.peak("fp32"), "bandwidth": gpu.memory_bandwidth, "half_dim": constants.gemm_half_dim}
    grouped = fit_grouped_gemm_efficiency(measured["grouped_gemm"], bytes_per_element=4.0, **rates)
    assert constants.moe_grouped_gemm_efficiency == pytest.approx(grouped)
    # 4 workers on the shared cores time their links within an order of magnitude of each other
    # from run to run; the bounds catch a unit slip (1,000 x), not the machine's load
    assert 0.01 < constants.moe_exchange_efficiency < 100.0 and 0.01 < constants.moe_grouped_gemm_efficiency < 100.0


@pytest.mark.parametrize("variant", ["zb_v", "dualpipev", "zb_h1_zero2"])
@pytest.mark.parametrize("layout", sorted(SCHEDULE_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bytes_per_rank_match_zero_bubble(layout, variant):
    """The V placement (rank 0: the first and the last stage, one tied embedding) and ZB-H1 with
    sharded gradients (every bucket kept from its first B to the W completing its chunk): bytes and
    transients per rank exactly the planner's, float64 as twice float32."""
    import dataclasses

    if variant == "zb_h1_zero2" and layout[2] == 1:
        pytest.skip("sharded variants run where dp > 1")
    config = variant_config(variant, *layout)
    as_float32 = dataclasses.replace(config, model=dataclasses.replace(config.model, params_dtype="float32"))
    halved = ("params", "grads", "optimizer", "grads_transient", "params_transient")
    measured = [
        {k: v // 2 if k in halved else v for k, v in r[variant]["measured"].items()} for r in parallel_run(*layout)
    ]
    check = compare(as_float32, measured, None, None)
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    if variant == "zb_h1_zero2":
        assert all(row["transients"]["measured"]["grads_transient"] > 0 for row in check["ranks"])
