"""A run's config.json, given back to ``ptdp train --config``, replays the run bitwise (two runs of
the command; the config files themselves: tests/unit/test_config_files.py)."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.cli import run


@pytest.mark.slow
def test_a_run_replays_from_its_config_json(profiled_run, tmp_path):
    """A run's config.json (the session's profiled run: tiny model at (1,2,1) with hidden dropout
    0.1 and --profile), given back with --config (and a new --output-dir), trains bitwise the same:
    every logged loss and gradient norm, and the validation losses."""
    first = profiled_run.run_dir
    again = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            "--config",
            str(first / "config.json"),
            "--output-dir",
            str(tmp_path / "b"),
            "--no-progress",
        ],
        tmp_path,
        env={"PTDP_CACHE_DIR": str(profiled_run.cache)},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = {
        run_dir: [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for run_dir in (first, tmp_path / "b")
    }
    timed = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes")  # measured, not trained
    strip = [{k: v for k, v in r.items() if k not in timed} for r in lines[first]]
    assert strip == [{k: v for k, v in r.items() if k not in timed} for r in lines[tmp_path / "b"]]
    assert any("loss" in r for r in strip) and any("val_loss" in r for r in strip)
    record = json.loads((tmp_path / "b" / "config.json").read_text())
    assert record["requested_vocab_size"] == 400 and record["output_dir"] == str(tmp_path / "b")
