"""What a finished tiny ``ptdp train`` run wrote into its run directory."""

from __future__ import annotations

import json
from pathlib import Path


def check_run_dir(run_dir: Path, iters: int, layout: dict, logged: tuple[int, ...] = (1, 2, 4, 6)) -> None:
    """The run directory of a tiny run (6 iterations, validation at 0, 3 and 6): its config, the
    training lines of the ``logged`` iterations (``--log-interval 2``: 1, 2, 4, 6), the summary."""
    config = json.loads((run_dir / "config.json").read_text())
    assert config["parallel"]["data_parallel_size"] == layout["dp"]
    assert config["model"]["vocab_size"] <= 400 and config["requested_vocab_size"] == 400
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["iteration"] for r in train] == list(logged)
    for r in train:
        assert set(r) == {
            "iteration",
            "loss",
            "grad_norm",
            "lr",
            "step_time_s",
            "tokens_per_s",
            "tflops_per_gpu",
            "peak_memory_bytes",
        }  # no mfu: no calibrated CPU profile in the test's cache
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["tflops_per_gpu"] > 0 and r["peak_memory_bytes"] > 0
    assert [r["iteration"] for r in evals] == [0, 3, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == iters and summary["layout"]["tp"] == layout["tp"]
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert train[-1]["loss"] < train[0]["loss"], "loss falls on a tiny corpus"
