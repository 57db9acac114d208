"""What several end-to-end tests read and none changes, run once for the session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.cli import TINY, FinishedRun, run, write_docs
from helpers.pp2_dp2_runs import train_pp2_dp2
from helpers.proc_helpers import Finished

#: The profiled run's flags after ``ptdp train``: the tiny model at (1,2,1) with hidden dropout,
#: torch.profiler on steps 1 and 2 (iterations 2 and 3) of both ranks, each worker bound to CPUs of
#: its own.
PROFILED_FLAGS = [
    *TINY,
    "--tp",
    "1",
    "--pp",
    "2",
    "--dp",
    "1",
    "--hidden-dropout",
    "0.1",
    "--profile",
    "--profile-step-start",
    "1",
    "--profile-step-end",
    "3",
    "--profile-ranks",
    "0,1",
    "--bind-cpus",
    "exclusive",
    "--no-progress",
]


@pytest.fixture(scope="session")
def profiled_run(corpus, tmp_path_factory) -> FinishedRun:
    """``ptdp train`` (elastic launcher, 2 workers) with :data:`PROFILED_FLAGS` on ``corpus/docs``
    into ``a`` (asserting it succeeded): the run whose traces and peak memory ``--profile`` is
    checked on, whose printed CPU binding plan and config ``--bind-cpus`` is checked on, and which
    ``--config a/config.json`` replays. Read-only."""
    root = tmp_path_factory.mktemp("profiled")
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *PROFILED_FLAGS,
            "--data",
            str(corpus / "docs"),
            "--output-dir",
            str(root / "a"),
        ],
        root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return FinishedRun(root / "a", root / "cache", proc)


@pytest.fixture(scope="session")
def pp2_dp2_workspace(tmp_path_factory) -> Path:
    """A small real-text corpus (``docs``, 16 modules of the ``email`` package) and a data cache
    (``cache``, tokenized by the first run) for the (1,2,2) runs of helpers/pp2_dp2_runs.py."""
    root = tmp_path_factory.mktemp("pp2_dp2")
    write_docs(root / "docs", 16)
    return root


@pytest.fixture(scope="session")
def pp2_dp2_uninterrupted(pp2_dp2_workspace) -> Finished:
    """The uninterrupted (1,2,2) run (``whole``, checkpoints in ``whole-ckpt``; asserted to
    succeed): what a restarted run resumes to and what two launchers joined on loopback train.
    Read-only."""
    proc = train_pp2_dp2(pp2_dp2_workspace, "whole", [], kill=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
