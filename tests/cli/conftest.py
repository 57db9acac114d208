"""The tier of commands that run as one process at a time (a command without a launcher, or whose
launcher stops before any worker): it keeps one core busy, so it runs beside the multi-process
tiers (tests/conftest.py)."""

from __future__ import annotations

import pytest

from helpers.cli import FinishedRun, train_uninterrupted


@pytest.fixture(scope="session")
def uninterrupted(corpus, tmp_path_factory) -> FinishedRun:
    """``python -m ptdp.train`` (no launcher) of the tiny model at (1,1,1) for 6 iterations on
    ``corpus/docs``, every iteration logged: the run the save-and-resume tests (plain and
    ``--async-save``) compare with, and the worker module's own end-to-end check. Read-only."""
    return train_uninterrupted(corpus, tmp_path_factory.mktemp("uninterrupted"))
