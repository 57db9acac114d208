"""``benchmarks/gpu_run.sh`` on the CPU (``--device cpu --quick``): its three commands run every stage
of the GPU check with ``PYTHONPATH=src``, each writing its report and its log."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import budget
from helpers.proc_helpers import run_together

ROOT = Path(__file__).resolve().parents[2]


def gpu_run(group: str, out: str, cwd: Path, *extra: str):
    """``benchmarks/gpu_run.sh GROUP OUT --device cpu --quick EXTRA`` in ``cwd``, with this interpreter as ``python3``."""
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), group, out, "--device", "cpu", "--quick", *extra]
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    (done,) = run_together([cmd], timeout=budget.seconds(), env=env, cwd=cwd)
    return done


@pytest.mark.timeout(120)
def test_gpu_run_sh_stops_at_arguments_its_stages_refuse(tmp_path):
    """An option gpu_check.py does not know: the first stage refuses it, no later stage runs, exit 2."""
    done = gpu_run("first", "out", tmp_path, "--bogus")
    assert done.returncode == 2, done.stderr
    assert "stage eager refused its arguments" in done.stderr and "--bogus" in done.stdout  # tee: the log
    assert not (tmp_path / "out" / "gpu_check_probes.log").exists()


@pytest.mark.timeout(240)
def test_gpu_run_sh_first_runs_the_eager_probes_and_moe_stages(tmp_path):
    done = gpu_run("first", "out", cwd=tmp_path)  # a relative DIR is the caller's, not the checkout's
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check_eager.json",
        "gpu_check_eager.log",
        "gpu_check_moe.json",
        "gpu_check_moe.log",
        "gpu_check_probes.json",
        "gpu_check_probes.log",
    ]
    eager = json.loads((out / "gpu_check_eager.json").read_text())
    probes = json.loads((out / "gpu_check_probes.json").read_text())
    moe = json.loads((out / "gpu_check_moe.json").read_text())
    for r, stage in ((eager, "eager"), (probes, "probes"), (moe, "moe")):
        assert (r["stage"], r["complete"], r["failures"], r["device"]) == (stage, True, [], "cpu")
        assert r["budget_s"] == {"eager": 150, "probes": 150, "moe": 60}[stage]  # gpu_run.sh's budget
        assert f"--budget {r['budget_s']:g}" in r["command"] and r["git_commit"]
    (row,) = eager["rows"]
    assert (
        row["timed_steps"] == 3 and row["ratio_vs_plain"] > 0 and 0 < eager["max_loss_rel_diff_vs_float64_cpu"] < 1e-5
    )
    assert probes["probes"]["sdpa"]["default"]["backend"] == "FLASH_ATTENTION"
    assert moe["moe"]["grouped_gemm"]["status"] == "used" and moe["moe"]["training"]["falling"]
    log = (out / "gpu_check_eager.log").read_text()
    assert "stage eager" in log and "ratio" in log and "stage eager" in done.stdout


@pytest.mark.timeout(420)
def test_gpu_run_sh_second_runs_the_compiled_stage(tmp_path):
    done = gpu_run("second", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    r = json.loads((tmp_path / "out" / "gpu_check_compile.json").read_text())
    assert (r["stage"], r["complete"], r["failures"], r["budget_s"]) == ("compile", True, [], 420)
    (row,) = r["rows"]
    assert row["mode"] == "compile" and row["timed_steps"] == 3 and row["ratio_vs_plain"] > 0
    first = row["first_step_loss"]
    assert abs(first["ptdp"] - first["plain"]) <= 1e-4 * first["plain"]


@pytest.mark.timeout(240)
def test_gpu_run_sh_third_runs_the_fp8_and_zb_stages(tmp_path):
    done = gpu_run("third", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    r = json.loads((tmp_path / "out" / "gpu_check_fp8.json").read_text())
    assert (r["stage"], r["complete"], r["failures"], r["budget_s"], r["dtype"]) == ("fp8", True, [], 180, "bfloat16")
    runs = r["fp8"]["runs"]
    assert [run["name"] for run in runs] == ["bfloat16", "fp8 tensorwise", "fp8 rowwise", "fp8 blockwise"]
    assert all(run["falling"] for run in runs) and all(run["compared_steps"] == 4 for run in runs[1:])
    log = (tmp_path / "out" / "gpu_check_fp8.log").read_text()
    assert sum(line.startswith('{"stage": "fp8"') for line in log.splitlines()) == 4
    zb = json.loads((tmp_path / "out" / "gpu_check_zb.json").read_text())
    assert (zb["stage"], zb["complete"], zb["failures"], zb["budget_s"], zb["dtype"]) == (
        "zb",
        True,
        [],
        120,
        "float32",
    )
    assert [run["name"] for run in zb["zb"]["runs"]] == ["1f1b", "zb-h1", "zb-v"]
    assert all(run["max_loss_rel_diff"] <= zb["zb"]["loss_bound"] for run in zb["zb"]["runs"][1:])


def test_gpu_run_sh_refuses_an_unknown_stage(tmp_path):
    done = gpu_run("everything", "out", cwd=tmp_path)
    assert done.returncode == 2 and "usage:" in done.stderr and not (tmp_path / "out").exists()
