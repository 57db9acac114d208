"""End-to-end: ``ptdp train --nproc-per-node 2 --dp 2 --data-parallel-sharding-strategy
optim_grads_params`` (elastic launcher, 2 gloo workers, the tiny model in float32) trains 2 steps
with 300-element gradient buckets: the run's summary says the planner's bytes per rank equal the
measured ones, the shards (parameters, gradients, optimizer state each half of the stage's, plus
padding) and the transients at their peaks (gathered parameters, full-size gradient buckets), and
the summary lines print both."""

from __future__ import annotations

import json
import sys

from helpers.cli import run, tiny_flags


def test_ptdp_train_with_optim_grads_params_reports_the_planners_bytes(corpus, tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(train_iters=2, log_interval=1, eval_interval=100, params_dtype="float32")
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *flags,
            "--nproc-per-node",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "2",
            "--data-parallel-sharding-strategy",
            "optim_grads_params",
            "--ddp-bucket-size",
            "300",
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and 0 < summary["final_loss"] < 20
    check = summary["planner_check"]
    assert check["bytes_exact_on_every_rank"], check["ranks"]
    assert len(check["ranks"]) == 2
    for row in check["ranks"]:
        transients = row["transients"]
        assert transients["measured"] == transients["predicted"], row
        assert transients["predicted"]["params_transient"] > 0 and transients["predicted"]["grads_transient"] > 0
        n, pad = row["predicted"]["numel"], row["padding_elements"]
        assert row["measured"]["params"] == row["measured"]["grads"] == 4 * (n + pad) // 2, row
    assert "at their peaks: gathered params" in proc.stdout
    assert any("bytes equal on every rank" in line and line.endswith(": yes") for line in proc.stdout.splitlines())
