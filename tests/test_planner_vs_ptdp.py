"""Invariant 5: the planner's parameter, gradient and optimizer bytes per rank equal what ptdp's
training actually holds, for every tested layout; and the calibration fits."""

from __future__ import annotations

import pytest

from ptdp.planner.calibrate import fit_gemm_curve, fit_ring, load_profile, save_profile
from ptdp.planner.check import compare, format_comparison
from ptdp.planner.flops import gemm_efficiency
from ptdp.planner.hardware import CATALOG
from ptdp.planner.perf import DEFAULT_CONSTANTS
from layout_cases import EXTRA_VARIANT_LAYOUTS, parallel_run, variant_config
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
