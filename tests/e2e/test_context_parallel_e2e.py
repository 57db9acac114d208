"""End-to-end: ``ptdp train --nproc-per-node 4 --cp 2 --dp 2`` (elastic launcher, 4 gloo workers,
tp 1, pp 1) trains 2 steps of the tiny model with the distributed optimizer over the dp x cp ranks:
the run's config, summary and planner report say cp 2 over a world of 4, the step's key/value
traffic is counted on the cp axis and its gradients on the dp axis, and the planner's bytes per
rank (ZeRO-1 shards over dp x cp = 4 ranks) equal the measured ones. A ``--cp`` whose 2 cp chunks
do not divide the sequence exits 2 before any worker, naming the numbers."""

from __future__ import annotations

import json
import sys

from helpers.cli import run, tiny_flags


def test_ptdp_train_with_context_parallelism(corpus, tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(train_iters=2, log_interval=1, eval_interval=2, num_layers=2)
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *flags,
            "--nproc-per-node",
            "4",
            "--tp",
            "1",
            "--pp",
            "1",
            "--cp",
            "2",
            "--dp",
            "2",
            "--use-distributed-optimizer",
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ptdp train: 4 workers, tp=1 cp=2 pp=1 dp=2" in proc.stdout
    assert "context-parallel traffic of the last step on rank 0: " in proc.stdout
    config = json.loads((out / "config.json").read_text())["parallel"]
    assert (config["context_parallel_size"], config["data_parallel_size"], config["cp_comm_type"]) == (2, 2, "p2p")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["layout"] == {
        "tp": 1,
        "cp": 2,
        "pp": 1,
        "dp": 2,
        "world_size": 4,
        "num_microbatches": 2,
    }
    assert 0 < summary["final_loss"] < 20 and summary["final_val_loss"] > 0
    comm = summary["comm_per_step_rank0"]
    assert comm["cp/send/cp_attention_forward"]["calls"] == 2 * 2  # C - 1 = 1 per layer and microbatch
    assert comm["dp/reduce_scatter/grads"]["calls"] >= 1 and comm["dp/all_gather/params"]["calls"] >= 1
    check = summary["planner_check"]
    assert check["bytes_exact_on_every_rank"], check["ranks"]
