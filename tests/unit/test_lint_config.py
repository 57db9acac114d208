"""What CI lints: ``ruff check .`` and ``ruff format --check .`` (``.ci/run``) reach every Python
file of the project. Ruff's default ``exclude`` skips any folder named ``dist``, which is the name
of the multi-process test tier (``tests/dist``); ``[tool.ruff]`` in ``pyproject.toml`` replaces
that list so the tier is linted and format-checked like the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("src", "tests", "benchmarks", "examples")


def _ruff_files() -> set[Path]:
    """The files ``ruff check .`` reads, run from the repository root (``ruff format`` resolves its
    files with the same ``[tool.ruff]`` settings)."""
    pytest.importorskip("ruff")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {Path(line.strip()).resolve() for line in proc.stdout.splitlines() if line.strip().endswith(".py")}


def _project_files() -> set[Path]:
    return {p.resolve() for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}


def test_ruff_reads_every_python_file_of_the_project():
    files = _project_files()
    assert any(p.parent.name == "dist" for p in files)  # tests/dist holds Python files
    missing = sorted(str(p.relative_to(ROOT)) for p in files - _ruff_files())
    assert not missing, f"ruff skips {len(missing)} files: {missing[:5]}"
