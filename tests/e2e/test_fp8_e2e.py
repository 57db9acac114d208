"""End-to-end: a short FP8 run (``--fp8``: hybrid formats, delayed scaling; emulated on the CPU) on
11 packages of the standard library ends within 2% of the bf16 run's validation loss, from the same
weights and data; the FP8 run's numbers differ from bf16's (the GEMMs were quantised)."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.cli import run, stdlib_corpus_flags

SHORT = [
    "--tp", "1", "--pp", "1", "--dp", "1", "--bf16",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--vocab-size", "1024", "--micro-batch-size", "8", "--global-batch-size", "8",
    "--train-iters", "100", "--eval-interval", "100", "--eval-iters", "8", "--no-progress",
]  # fmt: skip


@pytest.mark.slow
def test_short_fp8_run_ends_within_two_percent_of_bf16(tmp_path):
    valid = {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8"])):
        out = tmp_path / name
        flags = [*SHORT, *stdlib_corpus_flags(), *extra, "--output-dir", str(out)]
        proc = run([sys.executable, "-m", "ptdp.cli", "train", *flags], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        valid[name] = [r["val_loss"] for r in lines if "val_loss" in r]
    bf16, fp8 = valid["bf16"], valid["fp8"]
    assert bf16[-1] < 0.9 * bf16[0]  # it trained
    assert abs(fp8[-1] - bf16[-1]) <= 0.02 * bf16[-1], (fp8, bf16)
    assert fp8 != bf16
