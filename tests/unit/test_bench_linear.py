"""The linear-layer benchmark at a tiny size: every variant timed and compared with ``F.linear``."""

from __future__ import annotations

import json
import math

import pytest

from helpers.bench_scripts import import_scripts


@pytest.fixture
def bench(monkeypatch):
    (module,) = import_scripts(monkeypatch, "bench_linear")
    return module


def run(bench, capsys, *argv: str) -> tuple[int, dict]:
    code = bench.main(["--tokens", "32", "--hidden", "16", "--reps", "2", "--warmup", "1", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_eager_variants_match_f_linear_and_fp8_is_close(bench, capsys):
    code, out = run(bench, capsys, "--modes", "eager")
    assert code == 0 and out["failures"] == []
    rows = {(r["dtype"], r["variant"]): r for r in out["rows"]}
    variants = ["F.linear", "ptdp", "ptdp main_grad", "fp8 tensorwise", "fp8 rowwise"]
    assert list(rows) == [(d, v) for d in ("float32", "bfloat16") for v in variants]
    for (dtype, variant), r in rows.items():
        assert r["reps"] == 2 and r["median_s"] > 0
        base = rows[(dtype, "F.linear")]["median_s"]
        assert math.isclose(r["ratio_vs_F_linear"], r["median_s"] / base, rel_tol=1e-12)
        if variant.startswith("fp8"):  # e4m3 inputs and weights, e5m2 output gradients: a few percent
            assert 1e-3 < r["max_rel_diff_vs_F_linear"] < 0.2
        else:
            assert r["max_rel_diff_vs_F_linear"] == 0


def test_compiled_variants_and_a_difference_fails(bench, capsys, monkeypatch):
    """Compiled (most of the time: importing torch._dynamo), then ptdp's linear off by 0.1% in eager."""
    code, out = run(bench, capsys, "--modes", "compile", "--dtype", "float32", "--fp8-recipes")
    assert code == 0 and [r["variant"] for r in out["rows"]] == ["F.linear", "ptdp", "ptdp main_grad"]
    real = bench.linear
    monkeypatch.setattr(bench, "linear", lambda x, w, b, plan=None: real(x, w, b, plan) * 1.001)
    code, out = run(bench, capsys, "--modes", "eager", "--dtype", "float32", "--fp8-recipes")
    assert code == 1 and len(out["failures"]) == 2 and "ptdp differs from F.linear" in out["failures"][0]
