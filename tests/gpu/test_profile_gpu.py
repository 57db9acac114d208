"""``ptdp train`` on 2 GPUs (NCCL, bfloat16 by default there) with ``--profile`` and ``--trace``: the
profiler's trace holds CUDA kernels, ``--trace`` spans come from CUDA events, and the summary gives
``torch.cuda.max_memory_allocated`` per rank (skipped with fewer than 2 GPUs)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers.cli import run, tiny_flags

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.timeout(600)
def test_profile_trace_and_peak_memory_on_gpus(corpus, tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(train_iters=4, eval_iters=0, tp=1, pp=2, dp=1)
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *flags,
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
            "--profile",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "3",
            "--profile-ranks",
            "0,1",
            "--trace",
            "--trace-iters",
            "2",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        events = json.loads((out / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events), "no CUDA kernel in the profile"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peak_memory_measure"] == "torch.cuda.max_memory_allocated"
    assert all(b > 0 for b in summary["peak_memory_bytes_by_rank"].values())
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and all(e["dur"] >= 0 for e in spans)
    assert sum(e["cat"] == "forward" for e in spans if e["pid"] == 0 and e["args"]["iteration"] == 2) == 4
