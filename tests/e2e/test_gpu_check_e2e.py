"""``benchmarks/gpu_check.py --device cpu --quick``: the GPU check's CPU mode writes a sane report."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from helpers.proc_helpers import run_together

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_gpu_check_cpu_quick_report(tmp_path):
    out = tmp_path / "check.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_check.py"),
        "--device",
        "cpu",
        "--quick",
        "--peak-tflops",
        "0.5",
        "--output",
        str(out),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    (done,) = run_together([cmd], timeout=90, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    for key in ("device", "tokens_per_s", "mfu", "ratio_vs_plain", "max_loss_rel_diff_vs_float64_cpu", "rows"):
        assert key in r, key
    assert r["device"] == "cpu" and r["dtype"] == "float32" and r["headline_mode"] == "eager"
    assert [row["mode"] for row in r["rows"]] == ["eager"]
    # the model FLOPs per token, 6 N + 12 l h s, counted here from the quick shape (tied embedding once,
    # no position table): N = l (12 h^2 + 13 h) + 2 h + V h
    m = r["model"]
    l, h, s, v = m["num_layers"], m["hidden_size"], m["seq_length"], m["vocab_size"]
    n = l * (12 * h * h + 13 * h) + 2 * h + v * h
    assert r["flops_per_token"] == 6 * n + 12 * l * h * s
    assert r["tokens_per_s"] > 0 and 0.2 < r["ratio_vs_plain"] < 5
    assert math.isclose(r["mfu"], r["flops_per_token"] * r["tokens_per_s"] / 0.5e12, rel_tol=1e-12)
    row = r["rows"][0]
    assert math.isclose(r["tokens_per_s"], r["batch"]["tokens_per_step"] / row["ptdp_step_s"], rel_tol=1e-12)
    assert math.isclose(row["ratio_vs_plain"], row["ptdp_step_s"] / row["plain_step_s"], rel_tol=1e-12)
    # float32 against float64 differs by rounding only, and not by nothing
    assert 0 < r["max_loss_rel_diff_vs_float64_cpu"] < 1e-5
    check = r["loss_check"]
    assert len(check["float64_cpu"]) == len(check["float32"]) == check["steps"] == 3
    assert abs(check["float64_cpu"][0] - math.log(check["model"]["vocab_size"])) < 0.1  # small init: ~ln V
    assert "ptdp GPU check on cpu" in done.stdout and "ratio" in done.stdout
