"""``ptdp train`` and ``python -m ptdp.train`` as one process: bad data and output folders are
answered before any worker, the worker module runs without a launcher, a run saves and resumes."""

from __future__ import annotations

import sys

from helpers.cli import TINY, run, save_and_resume
from helpers.run_dirs import check_run_dir


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
