"""The calibration's fits recover known values; the core-sharing term of the planner's step time
(the planner's bytes against ptdp's training: tests/dist/test_planner_vs_ptdp.py)."""

from __future__ import annotations

import pytest

from ptdp.planner.inputs.hardware import CATALOG
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.flops import gemm_efficiency
from ptdp.planner.time.profile import load_profile, save_profile
from ptdp.planner.time.profile_fit import fit_gemm_curve, fit_ring


def test_gemm_and_ring_fits_recover_known_values(tmp_path):
    samples = [
        {"m": m, "n": n, "k": k, "flops_per_s": 5e10 * gemm_efficiency(m, n, k, peak_fraction=1.0, half_dim=16.0)}
        for m, n, k in [(512, 192, 128), (128, 128, 32), (512, 2048, 128), (64, 64, 64), (1024, 1024, 1024)]
    ]
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


def test_linear_fit_and_core_sharing_model():
    from ptdp.planner.time.profile_fit import fit_linear
    from ptdp.planner.time.step_time import core_shared_step

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

    from ptdp.planner.candidate import Candidate
    from ptdp.planner.inputs.hardware import Cluster
    from ptdp.planner.inputs.models import gpt
    from ptdp.planner.time.step_time import evaluate_performance

    cpu = dataclasses.replace(
        CATALOG["a100-80gb"],
        name="local",
        peak_flops={"fp32": 1.6e11},
        memory_bandwidth=4e10,
        nvlink_bandwidth=1.5e9,
        network_bandwidth=1.5e9,
        gpus_per_node=8,
    )
    constants = dataclasses.replace(
        DEFAULT_CONSTANTS,
        gemm_peak_fraction=1.0,
        gemm_half_dim=0.0,
        hbm_efficiency=1.0,
        nvlink_efficiency=1.0,
        nvlink_latency=5e-4,
        layer_overhead=2e-3,
        head_overhead=5e-3,
    )
    model = gpt(4, 128, 4, seq_length=128, vocab_size=4096)
    layout = Candidate.of(2, 2, 2, 4, 32, precision="fp32")
    alone = evaluate_performance(model, layout, Cluster(cpu, 8, 8), constants)
    shared = evaluate_performance(model, layout, Cluster(dataclasses.replace(cpu, shared_cores=2), 8, 8), constants)
    assert alone.time.core_sharing == 0.0
    assert shared.time.core_sharing > 0.0
    assert shared.step_time == pytest.approx(alone.step_time + shared.time.core_sharing)
    no_overhead = evaluate_performance(
        model, layout, Cluster(cpu, 8, 8), dataclasses.replace(constants, layer_overhead=0.0, head_overhead=0.0)
    )
    # the last stage's microbatch pays 2 layers' and the head's overhead, m = 4 times
    assert alone.time.compute - no_overhead.time.compute == pytest.approx(4 * (2 * 2e-3 + 5e-3))
    plenty = evaluate_performance(model, layout, Cluster(dataclasses.replace(cpu, shared_cores=8), 8, 8), constants)
    assert plenty.time.core_sharing == 0.0


def test_moe_fits_recover_known_efficiencies():
    """All-to-alls timed as ``exchange_time`` at efficiency 0.4 (groups of 2 and 4, inside a node
    and across two) and experts' GEMMs at 0.7 of the roofline give back 0.4 and 0.7; times that
    never exceed the latency fit nothing (1.0)."""
    from functools import partial

    from ptdp.planner.time.collectives import Links
    from ptdp.planner.time.moe_time import exchange_time, experts_gemm_time
    from ptdp.planner.time.profile_fit import fit_exchange_efficiency, fit_grouped_gemm_efficiency

    links = Links(1.5e9, 4e8, 2e-4, 5e-4, 2)
    samples = [(g, n, exchange_time(n, g, links, efficiency=0.4)) for g in (2, 4) for n in (1 << 12, 1 << 16, 1 << 22)]
    assert fit_exchange_efficiency(samples, links) == pytest.approx(0.4, rel=1e-12)
    assert fit_exchange_efficiency([(4, 1 << 12, 1e-5)], links) == 1.0  # below the latency

    rates = {"peak_flops": 5e10, "bandwidth": 2e10, "half_dim": 16.0, "bytes_per_element": 4.0}
    gemms = partial(experts_gemm_time, peak_fraction=1.0, peak_flops=5e10, bandwidth=2e10, half_dim=16.0, element=4.0)
    shapes = [(2, 32, 32, 128), (8, 16, 64, 256), (32, 16, 32, 128), (4, 512, 256, 1024)]
    grouped = [
        {"experts": e, "rows": r, "hidden": h, "ffn": f, "seconds": gemms(e, r, h, f, f) / 0.7} for e, r, h, f in shapes
    ]
    assert fit_grouped_gemm_efficiency(grouped, **rates) == pytest.approx(0.7, rel=1e-12)


def test_experts_gemm_time_is_two_grouped_gemms_filling_the_gpu_together():
    """Compute-bound: each grouped GEMM's FLOPs at the efficiency of one (experts x rows, n, k)
    GEMM times the grouped efficiency; memory-bound: every expert's operands read once."""
    from ptdp.planner.time.flops import gemm_efficiency
    from ptdp.planner.time.moe_time import experts_gemm_time

    rates = dict(peak_flops=1e12, bandwidth=1e15, peak_fraction=0.5, half_dim=64.0, element=2.0)
    e, r, h, f1, f = 3, 16, 256, 512, 128
    want = sum(
        2 * e * r * n * k / (1e12 * gemm_efficiency(e * r, n, k, peak_fraction=0.5, half_dim=64.0) * 0.8)
        for n, k in ((f1, h), (h, f))
    )
    assert experts_gemm_time(e, r, h, f1, f, efficiency=0.8, **rates) == pytest.approx(want, rel=1e-12)
    slow_memory = dict(rates, bandwidth=1e3)
    bytes_read = sum(e * (r * k + k * n + r * n) * 2.0 for n, k in ((f1, h), (h, f)))
    assert experts_gemm_time(e, r, h, f1, f, **slow_memory) == pytest.approx(bytes_read / 1e3, rel=1e-12)
