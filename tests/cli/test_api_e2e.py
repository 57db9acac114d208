"""``ptdp.train(config)`` (docs/api.md) in a single process trains exactly what ``python -m
ptdp.train`` does with the same flags: the same losses and gradient norms, bitwise."""

from __future__ import annotations

import json
import sys

from helpers.cli import TINY_OPTIONS, make_corpus, run, tiny_flags, train_losses

SCRIPT = """
import json, sys
import ptdp
options = json.loads(sys.argv[1])
config = ptdp.load_config(**options)
summary = ptdp.train(config)
print("SUMMARY", json.dumps({"run_dir": summary["run_dir"], "final_loss": summary["final_loss"]}))
"""


def test_python_api_trains_like_the_worker_module(tmp_path):
    corpus = make_corpus(tmp_path)
    options = {key.replace("-", "_"): value for key, value in TINY_OPTIONS.items()}
    options.update(
        tp=1, pp=1, data=[str(corpus / "docs")], output_dir=str(tmp_path / "api"), log_interval=1, train_iters=3
    )
    api = run([sys.executable, "-c", SCRIPT, json.dumps(options)], tmp_path)
    assert api.returncode == 0, api.stderr[-3000:]
    line = next(x for x in api.stdout.splitlines() if x.startswith("SUMMARY "))
    summary = json.loads(line[len("SUMMARY ") :])
    assert summary["run_dir"] == str(tmp_path / "api")
    cli = run(
        [
            sys.executable,
            "-m",
            "ptdp.train",
            *tiny_flags(log_interval=1, train_iters=3),
            "--tp",
            "1",
            "--pp",
            "1",
            "--data",
            str(corpus / "docs"),
            "--no-progress",
            "--output-dir",
            str(tmp_path / "cli"),
        ],
        tmp_path,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    losses = train_losses(tmp_path / "api")
    assert len(losses) == 3
    assert losses == train_losses(tmp_path / "cli")
    assert summary["final_loss"] == losses[max(losses)][0]
