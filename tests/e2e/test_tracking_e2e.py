"""``ptdp train`` with ``--tensorboard-dir`` and ``--wandb-project``: TensorBoard event files hold the
loss, learning rate, throughput and TFLOP/s of every metrics line; W&B writes an offline run
folder without a network or an API key; metrics.jsonl's throughput fields are consistent with the
step time and the planner's FLOP count (a tracker that is not installed: tests/unit/test_tracking.py)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.cli import TINY, run

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def k22_model_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """[K22] §6 model FLOPs of one step, written out here (the planner's count for GPT)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * h * l))


def event_scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_and_offline_wandb_get_the_metrics_with_throughput(corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key and no mode: offline
    monkeypatch.delenv("WANDB_MODE", raising=False)
    env = {"WANDB_SILENT": "true"}
    proc = run([sys.executable, "-m", "ptdp.cli", "train", *TINY, "--tp", "1", "--pp", "2", "--dp", "1",
                "--data", str(corpus / "docs"), "--output-dir", "run", "--no-progress", "--tensorboard-dir", "tb",
                "--wandb-project", "ptdp-test", "--wandb-exp-name", "tiny"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in lines if "loss" in r}
    val = {r["iteration"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert sorted(train) == [1, 2, 4, 6] and sorted(val) == [0, 3, 6]

    config = json.loads((run_dir / "config.json").read_text())
    m, t = config["model"], config["train"]
    tokens = t["global_batch_size"] * m["seq_length"]
    flops = k22_model_flops(t["global_batch_size"], m["seq_length"], m["num_layers"], m["hidden_size"],
                            m["vocab_size"])
    summary = json.loads((run_dir / "summary.json").read_text())
    largest_peak = max(summary["peak_memory_bytes_by_rank"].values())
    for r in train.values():
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-12)
        assert r["tflops_per_gpu"] == pytest.approx(flops / r["step_time_s"] / 2 / 1e12, rel=1e-12)
        assert "mfu" not in r  # float32 on a CPU without a calibrated profile: no known peak
        assert 2**20 < r["peak_memory_bytes"] <= largest_peak  # the largest rank's peak so far
    peaks = [train[i]["peak_memory_bytes"] for i in sorted(train)]
    assert peaks == sorted(peaks)
    assert summary["tflops_per_gpu"] == pytest.approx(flops / summary["mean_step_time_s"] / 2 / 1e12, rel=1e-12)

    scalars = event_scalars(tmp_path / "tb")
    for field, tag in [("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                       ("tokens_per_s", "throughput/tokens_per_s"), ("tflops_per_gpu", "throughput/tflops_per_gpu"),
                       ("peak_memory_bytes", "memory/peak_bytes")]:
        assert scalars[tag] == pytest.approx({i: r[field] for i, r in train.items()}, rel=1e-6), tag
    assert scalars["val/loss"] == pytest.approx(val, rel=1e-6)

    runs = list((run_dir / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").rglob("*"))
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())

