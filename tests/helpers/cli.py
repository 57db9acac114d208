"""What the end-to-end tests of ``ptdp train`` share: the tiny model's flags (defined once here, varied
with :func:`tiny_flags`), corpora of real text (modules of the standard library's ``email``
package), and running a command with a data cache of its own within the test's time budget."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from helpers import budget


#: The tiny model and short run of the end-to-end tests: flag (without ``--``) -> value.
TINY_OPTIONS: dict[str, str | bool] = {
    "num-layers": "2", "hidden-size": "32", "num-attention-heads": "4", "seq-length": "32", "vocab-size": "400",
    "micro-batch-size": "2", "global-batch-size": "8", "train-iters": "6", "lr-warmup-iters": "1",
    "log-interval": "2", "eval-interval": "3", "eval-iters": "1",
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


def run(cmd: list[str], tmp_path: Path, timeout: float | None = None, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``tmp_path`` with its data cache there, one thread per process and ``env``
    added, within what is left of the test's budget (at most ``timeout`` seconds)."""
    env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=budget.seconds(timeout), env=env,
                          cwd=tmp_path)
