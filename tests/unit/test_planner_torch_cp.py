"""``--cp-implementation torch``: PyTorch's experimental context parallelism merges each ring step's
output and accumulates the key/value gradients with out-of-place float32 tensor ops; the planner adds
their memory traffic to the context-parallel time."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.planner.inputs.models import get_model
from ptdp.planner.time.cp_exchange import (
    TORCH_MERGE_CALL_BACKWARD,
    TORCH_MERGE_CALL_FORWARD,
    TORCH_MERGE_STEP_BACKWARD,
    TORCH_MERGE_STEP_FORWARD,
    torch_merge_times,
)
from ptdp.planner.validate.published import load_h100_runs

LLAMA = get_model("llama3-8b")  # 32 heads of 128, 8 key/value heads
BW = 2.0e12
NEW = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_runs_out_of_sample.csv"


def test_nothing_without_context_parallelism():
    assert torch_merge_times(LLAMA, 1, 1, 1, BW) == (0.0, 0.0)


def test_forward_grows_with_the_steps_after_the_first_and_backward_with_every_step():
    """Per rank the block output is ``s / cp`` tokens: at a fixed ``s / cp`` the per-step bytes are
    fixed, so forward is ``(cp - 1)`` steps plus the call's casts, backward ``cp`` steps plus its
    own."""
    per_rank = 8192
    times = {
        cp: torch_merge_times(dataclasses.replace(LLAMA, seq_length=per_rank * cp), 1, cp, 1, BW) for cp in (2, 3, 5)
    }
    step_f = times[3][0] - times[2][0]
    step_b = times[3][1] - times[2][1]
    assert step_f > 0 and step_b > 0
    assert times[5][0] == pytest.approx(times[3][0] + 2 * step_f, rel=1e-12)
    assert times[5][1] == pytest.approx(times[3][1] + 2 * step_b, rel=1e-12)
    out = per_rank * 32 * 128  # elements of the block output; keys: 8 heads
    key = per_rank * 8 * 128
    assert step_f * BW == pytest.approx(TORCH_MERGE_STEP_FORWARD[0] * out + TORCH_MERGE_STEP_FORWARD[1] * key)
    assert step_b * BW == pytest.approx(TORCH_MERGE_STEP_BACKWARD[0] * out + TORCH_MERGE_STEP_BACKWARD[1] * key)
    once_f = times[2][0] * BW - step_f * BW
    once_b = times[2][1] * BW - 2 * step_b * BW
    assert once_f == pytest.approx(TORCH_MERGE_CALL_FORWARD[0] * out + TORCH_MERGE_CALL_FORWARD[1] * key)
    assert once_b == pytest.approx(TORCH_MERGE_CALL_BACKWARD[0] * out + TORCH_MERGE_CALL_BACKWARD[1] * key)


def test_repeated_heads_and_tensor_parallelism_scale_the_bytes():
    base = torch_merge_times(LLAMA, 1, 4, 1, BW)
    repeated = torch_merge_times(dataclasses.replace(LLAMA, kv_repeated=True), 1, 4, 1, BW)
    assert repeated[0] > base[0] and repeated[1] > base[1]
    halved = torch_merge_times(LLAMA, 2, 4, 1, BW)
    assert halved == pytest.approx((base[0] / 2, base[1] / 2), rel=1e-12)


def _cp_comm(capsys, *extra: str) -> float:
    flags = [
        "plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq-length", "65536",
        "--context-parallel-size", "4", "--data-parallel-size", "2", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--recompute-granularity", "full", "--json",
    ]  # fmt: skip
    assert main([*flags, *extra]) == 0
    return json.loads(capsys.readouterr().out)[0]["time_s"]["cp_comm"]


def test_plan_adds_the_traffic_with_the_flag_and_says_so(capsys):
    te = _cp_comm(capsys)
    assert _cp_comm(capsys, "--cp-implementation", "te") == te
    assert _cp_comm(capsys, "--cp-implementation", "torch") > te
    assert (
        main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--cp-implementation", "torch"]) == 0
    )
    assert "--cp-implementation torch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_code:
        main(["plan", "--model", "llama3-8b", "--gpus", "8", "--cp-implementation", "ring"])
    assert exit_code.value.code == 2 and "invalid choice: 'ring'" in capsys.readouterr().err


def test_torchtitan_context_parallel_rows_use_it_and_a_bad_cell_is_refused(tmp_path, capsys):
    runs = load_h100_runs(NEW)
    torch_rows = [r for r in runs if r.cp_implementation == "torch"]
    assert len(torch_rows) == 6
    assert all(r.source_key == "pytorch/torchtitan" and r.layout.cp > 1 for r in torch_rows)
    lines = NEW.read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    bad = tmp_path / "bad.csv"
    with open(NEW, newline="", encoding="utf-8") as f:
        first = next(csv.DictReader(f))
    with open(bad, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerow({**first, "cp_implementation": "ring"})
    assert main(["plan", "--validate", str(bad)]) == 2
    assert f"{bad}:2: cp_implementation='ring' must be one of te, torch" in capsys.readouterr().err
