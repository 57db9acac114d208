"""End-to-end: ``ptdp train`` (elastic launcher, 8 gloo workers, tp=2 pp=2 dp=2) and
``torchrun -m ptdp.train`` with a tiny model on a tiny corpus."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers.cli import TINY, run, save_and_resume
from helpers.tracked_runs import TRACKER_FLAGS, check_tracked_run, offline_wandb


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


def test_ptdp_train_default_layout(corpus, tmp_path):
    out = tmp_path / "run"
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--data",
            str(corpus / "docs"),
            "--data",
            str(corpus / "extra.jsonl"),
            "--output-dir",
            str(out),
            "--no-progress",
            "--trace",
            "--trace-iters",
            "2",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp=2 pp=2 dp=2" in proc.stdout
    assert "validation loss" in proc.stdout and "pipeline bubble (1f1b)" in proc.stdout
    check_run_dir(out, 6, {"tp": 2, "pp": 2, "dp": 2})
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert {e["args"]["iteration"] for e in spans} == {2, 3}
    for rank in range(8):  # m = 2 microbatches: 2 forwards and 2 backwards per traced iteration
        mine = [e for e in spans if e["pid"] == rank and e["args"]["iteration"] == 2]
        assert sum(e["cat"] == "forward" for e in mine) == 2 and sum(e["cat"] == "backward" for e in mine) == 2
        assert any(e["cat"] == "transfer" for e in mine)  # each p2p group, posted and waited for
        assert all(e["dur"] >= 0 for e in mine)
    assert (out / "timeline.png").stat().st_size > 5000
    bubble = json.loads((out / "summary.json").read_text())["bubble"]
    assert len(bubble["measured_idle_over_compute_by_rank"]) == 8 and bubble["formula_(p-1)/(v*m)"] == 0.5
    again = run(
        [sys.executable, "-m", "ptdp.cli", "train", *TINY, "--data", str(corpus / "docs"), "--output-dir", str(out)],
        tmp_path,
    )
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def test_torchrun_entry_point(corpus, tmp_path, monkeypatch):
    """torchrun at (1,2,1), with --tensorboard-dir and an offline W&B run: the run directory, the
    throughput of its metrics lines and what the trackers got (helpers.tracked_runs)."""
    out = tmp_path / "run"
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ptdp.train",
            *TINY,
            "--tp",
            "1",
            "--pp",
            "2",
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
            *TRACKER_FLAGS,
        ],
        tmp_path,
        env=offline_wandb(monkeypatch),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_run_dir(out, 6, {"tp": 1, "pp": 2, "dp": 1})
    check_tracked_run(out, tmp_path / "tb", world=2)


def test_bad_data_path_is_a_clear_error(tmp_path):
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--data",
            str(tmp_path / "missing"),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert proc.returncode == 2
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_corpus_too_small_for_one_global_batch(tmp_path):
    docs = tmp_path / "small"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 5, encoding="utf-8")
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--data",
            str(docs),
            "--valid-fraction",
            "0.3",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fewer than global_batch_size=8" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_non_finite_loss_stops_with_a_clear_error(corpus, tmp_path):
    """2 workers (tp1 pp2): every rank stops, the launcher reports it once, without a traceback."""
    out = tmp_path / "run"
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--tp",
            "1",
            "--pp",
            "2",
            "--dp",
            "1",
            "--lr",
            "1e30",
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(out),
            "--no-progress",
            "--max-skipped-steps",
            "1",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "is not finite at iteration" in proc.stderr and "Traceback" not in proc.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert all("NaN" not in line and "Infinity" not in line for line in lines), "strict JSON"
    assert json.loads(lines[-1])["loss"] is None


def test_output_dir_problems_are_found_before_data_preparation(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("x")
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *TINY,
            "--data",
            str(tmp_path / "missing"),
            "--output-dir",
            str(target),
        ],
        tmp_path,
    )
    assert proc.returncode == 2 and "exists and is not a directory" in proc.stderr
    assert "missing" not in proc.stderr, "the output directory is checked before the data"


def test_train_module_runs_without_a_launcher(uninterrupted):
    """``python -m ptdp.train`` at (1,1,1), every iteration logged: the session's uninterrupted run
    (its command: helpers.cli.uninterrupted_flags; it succeeded)."""
    assert "validation loss" in uninterrupted.proc.stderr
    check_run_dir(uninterrupted.run_dir, 6, {"tp": 1, "pp": 1, "dp": 1}, logged=(1, 2, 3, 4, 5, 6))


#: The 1-bit test's corpus: 11 packages of the standard library, 3.2M characters, 815k training and
#: 12k validation tokens, prepared in about 2 s (the default corpus, the whole standard library, has
#: 9.4M tokens and took 20 s, more than the 410k tokens the 100 iterations read).
ONE_BIT_CORPUS = (
    "asyncio",
    "email",
    "unittest",
    "multiprocessing",
    "logging",
    "importlib",
    "http",
    "xml",
    "json",
    "concurrent",
    "urllib",
)


@pytest.mark.slow
def test_one_bit_compression_trains_like_uncompressed(tmp_path):
    """The default model with 2 layers instead of 4 (h 128, s 128, vocabulary 4096), 100 iterations
    at dp = 2 (tp = pp = 1) on 11 packages of the standard library, the first 30 (the learning-rate
    warmup) exact: the validation loss with 1-bit gradients and error feedback is within 5% of fp32
    gradients' (1.80% measured: 4.797 against 4.712, from 8.324; 4 layers: 1.98%, 4.867 against
    4.773), the fp32 run learns (0.57 of its start), and 1-bit sends over 20x fewer data-parallel
    bytes (21.3x measured)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = [arg for package in ONE_BIT_CORPUS for arg in ("--data", str(stdlib / package))]
    results = {}
    for codec in ("none", "1bit"):
        out = tmp_path / codec
        proc = run(
            [
                sys.executable,
                "-m",
                "ptdp.cli",
                "train",
                "--tp",
                "1",
                "--pp",
                "1",
                "--dp",
                "2",
                *data,
                "--num-layers",
                "2",
                "--train-iters",
                "100",
                "--lr-warmup-iters",
                "30",
                "--eval-interval",
                "100",
                "--eval-iters",
                "2",
                "--log-interval",
                "50",
                "--grad-compression",
                codec,
                "--output-dir",
                str(out),
                "--no-progress",
            ],
            tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        results[codec] = summary
    none, one_bit = results["none"]["final_val_loss"], results["1bit"]["final_val_loss"]
    assert none < 0.6 * results["none"]["initial_val_loss"], "the uncompressed run learns"
    assert abs(one_bit - none) <= 0.05 * none, (one_bit, none)
    dp_bytes = {
        c: sum(v["bytes"] for k, v in r["comm_per_step_rank0"].items() if k.startswith("dp/"))
        for c, r in results.items()
    }
    assert dp_bytes["1bit"] * 20 < dp_bytes["none"], dp_bytes


def test_save_and_resume_from_the_command_line(corpus, tmp_path, uninterrupted):
    """6 iterations in one run (the session's ``uninterrupted`` run) == 3, saved, then resumed for
    3 more (bitwise losses and norms); a checkpoint folder per save, ``latest`` on the newest,
    ``--keep-last`` prunes."""
    base, ckpt, _, second = save_and_resume(corpus, tmp_path, uninterrupted)
    assert "resumed from" in second.stderr
    gen = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "generate",
            "--load",
            str(ckpt),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "5",
        ],
        tmp_path,
    )
    assert gen.returncode == 0 and gen.stdout.startswith("def"), gen.stderr[-2000:]
    missing = run(base + ["--load", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "third")], tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
