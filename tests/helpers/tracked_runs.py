"""What a tiny ``ptdp train`` run with the experiment trackers wrote, checked: its metrics lines'
throughput against the step time and [K22]'s FLOP count, the TensorBoard scalars against the
lines, the offline W&B run folder. Used by the torchrun end-to-end run (tests/e2e/test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: The trackers' flags of the checked run: TensorBoard events into ``tb`` (relative to the run's
#: working directory) and an offline W&B run (no API key, no network) in the run directory.
TRACKER_FLAGS = ["--tensorboard-dir", "tb", "--wandb-project", "ptdp-test", "--wandb-exp-name", "tiny"]


def offline_wandb(monkeypatch) -> dict[str, str]:
    """No W&B key or mode in the environment (so ptdp picks offline); the env to add (quiet W&B)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return {"WANDB_SILENT": "true"}


def k22_model_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """[K22] §6 model FLOPs of one step, written out here (the planner's count for GPT)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * h * l))


def event_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Tag -> {step: value} of the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def check_tracked_run(run_dir: Path, tb_dir: Path, world: int, logged: tuple[int, ...] = (1, 2, 4, 6)) -> None:
    """The run in ``run_dir`` (float32 on CPUs without a calibrated profile, ``world`` processes)
    logged ``logged`` iterations with consistent throughput, and its trackers got the same numbers."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in lines if "loss" in r}
    val = {r["iteration"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert sorted(train) == list(logged)
    config = json.loads((run_dir / "config.json").read_text())
    m, t = config["model"], config["train"]
    tokens = t["global_batch_size"] * m["seq_length"]
    flops = k22_model_flops(t["global_batch_size"], m["seq_length"], m["num_layers"], m["hidden_size"], m["vocab_size"])
    summary = json.loads((run_dir / "summary.json").read_text())
    largest_peak = max(summary["peak_memory_bytes_by_rank"].values())
    for r in train.values():
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-12)
        assert r["tflops_per_gpu"] == pytest.approx(flops / r["step_time_s"] / world / 1e12, rel=1e-12)
        assert "mfu" not in r  # float32 on a CPU without a calibrated profile: no known peak
        assert 2**20 < r["peak_memory_bytes"] <= largest_peak, (r, summary["peak_memory_bytes_by_rank"])
    peaks = [train[i]["peak_memory_bytes"] for i in sorted(train)]
    assert peaks == sorted(peaks)
    assert summary["tflops_per_gpu"] == pytest.approx(flops / summary["mean_step_time_s"] / world / 1e12, rel=1e-12)

    scalars = event_scalars(tb_dir)
    for field, tag in [
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_s", "throughput/tokens_per_s"),
        ("tflops_per_gpu", "throughput/tflops_per_gpu"),
        ("peak_memory_bytes", "memory/peak_bytes"),
    ]:
        assert scalars[tag] == pytest.approx({i: r[field] for i, r in train.items()}, rel=1e-6), tag
    assert scalars["val/loss"] == pytest.approx(val, rel=1e-6)

    runs = list((run_dir / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").rglob("*"))
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())
