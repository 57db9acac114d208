"""A run's config.json, given back to ``ptdp train --config``, replays the run bitwise (two runs of
the command; the config files themselves: tests/unit/test_config_files.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import budget
from helpers.cli import TINY


@pytest.mark.slow
def test_a_run_replays_from_its_config_json(corpus, tmp_path):
    """A run's config.json, given back with --config (and a new --output-dir), trains bitwise the
    same: every logged loss and gradient norm, and the validation losses."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")

    def train(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ptdp.cli", "train", *argv, "--no-progress"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=budget.seconds())

    first = train(*TINY, "--tp", "1", "--pp", "2", "--dp", "1", "--hidden-dropout", "0.1",
                  "--data", str(corpus / "docs"), "--output-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    again = train("--config", str(tmp_path / "a" / "config.json"), "--output-dir", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]
    lines = {run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("a", "b")}
    strip = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")} for r in lines["a"]]
    assert strip == [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")} for r in lines["b"]]
    assert any("loss" in r for r in strip) and any("val_loss" in r for r in strip)
    record = json.loads((tmp_path / "b" / "config.json").read_text())
    assert record["requested_vocab_size"] == 400 and record["output_dir"] == str(tmp_path / "b")
