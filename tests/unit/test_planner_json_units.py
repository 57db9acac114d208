"""Units of ``ptdp plan --json``: ``tflops_per_gpu`` is in TFLOP/s, as the text table prints it."""

from __future__ import annotations

import json

from ptdp.cli import main

GPT3 = [
    "plan",
    "--model",
    "gpt3-175b",
    "--gpus",
    "1024",
    "--gpu",
    "a100-80gb",
    "--global-batch-size",
    "1536",
    "--seq-length",
    "2048",
]


def test_json_tflops_per_gpu_is_in_tflops(capsys):
    assert main([*GPT3, "--json"]) == 0
    plans = [p for p in json.loads(capsys.readouterr().out) if p["fits"]]
    assert plans
    for plan in plans:  # an A100 peaks at 312 TFLOP/s in bf16: FLOP/s would read ~1e14
        assert 1.0 < plan["tflops_per_gpu"] < 2000.0, plan["tflops_per_gpu"]
        assert plan["tflops_per_gpu"] <= 312.0
    assert main(GPT3) == 0
    best = capsys.readouterr().out.split("best: ", 1)[1]
    assert f"{plans[0]['tflops_per_gpu']:.3f} TFLOP/s per GPU" in best
