"""What the end-to-end tests of ``ptdp train`` share: the tiny model's flags (defined once here, varied
with :func:`tiny_flags`), corpora of real text (modules of the standard library's ``email``
package), and running a command with a data cache of its own within the test's time budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from helpers import budget

#: The tiny model and short run of the end-to-end tests: flag (without ``--``) -> value.
TINY_OPTIONS: dict[str, str | bool] = {
    "num-layers": "2",
    "hidden-size": "32",
    "num-attention-heads": "4",
    "seq-length": "32",
    "vocab-size": "400",
    "micro-batch-size": "2",
    "global-batch-size": "8",
    "train-iters": "6",
    "lr-warmup-iters": "1",
    "log-interval": "2",
    "eval-interval": "3",
    "eval-iters": "1",
}


def tiny_flags(**changes: str | int | bool | None) -> list[str]:
    """The tiny model's flags with ``changes``: ``train_iters=10`` gives ``--train-iters 10``, None
    drops a flag, True adds one that takes no value (``no_progress=True``: ``--no-progress``)."""
    options = dict(TINY_OPTIONS)
    for key, value in changes.items():
        name = key.replace("_", "-")
        if value is None:
            options.pop(name, None)
        else:
            options[name] = value if value is True else str(value)
    flags: list[str] = []
    for name, value in options.items():
        flags += [f"--{name}"] if value is True else [f"--{name}", value]
    return flags


TINY = tiny_flags()


def email_texts(count: int) -> list[str]:
    """The text of the first ``count`` modules of the standard library's ``email`` package."""
    import email

    return [p.read_text(encoding="utf-8") for p in sorted(Path(email.__file__).parent.glob("*.py"))[:count]]


def write_docs(folder: Path, count: int, name: str = "doc{}.txt") -> Path:
    """``folder`` (created) with ``count`` text files, the first modules of the ``email`` package."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(email_texts(count)):
        (folder / name.format(i)).write_text(text, encoding="utf-8")
    return folder


def make_corpus(root: Path) -> Path:
    """A small real-text corpus in ``root``: ``docs/`` (16 files) and ``extra.jsonl`` (4 more documents)."""
    texts = email_texts(20)
    (root / "docs").mkdir()
    for i, text in enumerate(texts[:-4]):
        (root / "docs" / f"doc{i}.txt").write_text(text, encoding="utf-8")
    with open(root / "extra.jsonl", "w", encoding="utf-8") as f:
        for text in texts[-4:]:
            f.write(json.dumps({"text": text}) + "\n")
    return root


#: A corpus of 11 packages of the standard library: 3.2M characters, 815k training and 12k
#: validation tokens, prepared in about 2 s (the default corpus, the whole standard library, has
#: 9.4M tokens and took 20 s)
STDLIB_PACKAGES = (
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


def stdlib_corpus_flags() -> list[str]:
    """``--data`` flags of :data:`STDLIB_PACKAGES`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [arg for package in STDLIB_PACKAGES for arg in ("--data", str(stdlib / package))]


def run(
    cmd: list[str], tmp_path: Path, timeout: float | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``tmp_path`` with its data cache there, one thread per process and ``env``
    added (it may name another ``PTDP_CACHE_DIR``), within what is left of the test's budget (at
    most ``timeout`` seconds)."""
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=budget.seconds(timeout), env=env, cwd=tmp_path)


def train_losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Iteration -> (loss, grad_norm) of a run's metrics.jsonl training lines."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in lines if "loss" in r}


@dataclass(frozen=True)
class FinishedRun:
    """A training command that ran to its end: its run directory, its data cache and its process."""

    run_dir: Path
    cache: Path
    proc: subprocess.CompletedProcess


def uninterrupted_flags(corpus: Path) -> list[str]:
    """The command of the uninterrupted run and of the runs compared with it: ``python -m
    ptdp.train``, the tiny model at (1,1,1), every iteration logged, the learning rate decayed over
    6 iterations whatever ``--train-iters`` says."""
    import sys

    return [
        sys.executable,
        "-m",
        "ptdp.train",
        *TINY,
        "--tp",
        "1",
        "--pp",
        "1",
        "--data",
        str(corpus / "docs"),
        "--no-progress",
        "--log-interval",
        "1",
        "--lr-decay-iters",
        "6",
    ]


def train_uninterrupted(corpus: Path, root: Path) -> FinishedRun:
    """Run :func:`uninterrupted_flags` into ``root/whole`` with its data cache in ``root/cache``
    (asserting it succeeded)."""
    proc = run(uninterrupted_flags(corpus) + ["--output-dir", str(root / "whole")], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return FinishedRun(root / "whole", root / "cache", proc)


def save_and_resume(corpus: Path, tmp_path: Path, whole: FinishedRun, save_flags: tuple[str, ...] = ()):
    """The uninterrupted run ``whole`` (6 iterations) against 3 iterations saved after each one
    (``--keep-last 2``, plus ``save_flags``) and resumed from the newest for 3 more, on the same
    data cache; asserts the checkpoint folders and that the resumed losses and norms equal the
    uninterrupted run's bitwise. Returns ``(base flags, checkpoint folder, first run, resumed run)``."""
    base = uninterrupted_flags(corpus)
    cache = {"PTDP_CACHE_DIR": str(whole.cache)}
    ckpt = tmp_path / "ckpt"
    first = run(
        base
        + [
            "--train-iters",
            "3",
            "--save",
            str(ckpt),
            "--save-interval",
            "1",
            "--keep-last",
            "2",
            *save_flags,
            "--output-dir",
            str(tmp_path / "first"),
        ],
        tmp_path,
        env=cache,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    second = run(base + ["--load", str(ckpt), "--output-dir", str(tmp_path / "second")], tmp_path, env=cache)
    assert second.returncode == 0, second.stderr[-3000:]
    expected = train_losses(whole.run_dir)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert train_losses(tmp_path / "second") == {i: expected[i] for i in (4, 5, 6)}
    return base, ckpt, first, second


#: ptdp's CLI run in a process that reports its exit code and whether torch was imported
PROBE = """
import contextlib, io, sys
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print("exit", code)
print("torch imported:", "torch" in sys.modules)
print("ptdp modules:", sorted(m for m in sys.modules if m.startswith("ptdp")))
"""


def in_subprocess(args: list[str], tmp_path: Path, code: str = PROBE) -> str:
    """The output of ``code`` run as ``python -c code ARGS`` (ptdp's CLI arguments), which must exit 0."""
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
