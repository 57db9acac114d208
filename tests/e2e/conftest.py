"""What several end-to-end tests read and none changes, run once for the session."""

from __future__ import annotations

import sys

import pytest
from helpers.cli import TINY, FinishedRun, run, train_uninterrupted


@pytest.fixture(scope="session")
def uninterrupted(corpus, tmp_path_factory) -> FinishedRun:
    """``python -m ptdp.train`` (no launcher) of the tiny model at (1,1,1) for 6 iterations on
    ``corpus/docs``, every iteration logged: the run the save-and-resume tests (plain and
    ``--async-save``) compare with, and the worker module's own end-to-end check. Read-only."""
    return train_uninterrupted(corpus, tmp_path_factory.mktemp("uninterrupted"))


#: The profiled run's flags after ``ptdp train``: the tiny model at (1,2,1) with hidden dropout,
#: torch.profiler on steps 1 and 2 (iterations 2 and 3) of both ranks.
PROFILED_FLAGS = [*TINY, "--tp", "1", "--pp", "2", "--dp", "1", "--hidden-dropout", "0.1", "--profile",
                  "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "0,1", "--no-progress"]


@pytest.fixture(scope="session")
def profiled_run(corpus, tmp_path_factory) -> FinishedRun:
    """``ptdp train`` (elastic launcher, 2 workers) with :data:`PROFILED_FLAGS` on ``corpus/docs``
    into ``a`` (asserting it succeeded): the run whose traces and peak memory ``--profile`` is
    checked on, and which ``--config a/config.json`` replays. Read-only."""
    root = tmp_path_factory.mktemp("profiled")
    proc = run([sys.executable, "-m", "ptdp.cli", "train", *PROFILED_FLAGS, "--data", str(corpus / "docs"),
                "--output-dir", str(root / "a")], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return FinishedRun(root / "a", root / "cache", proc)
