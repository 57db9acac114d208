"""The scripts of ``benchmarks/`` imported by their plain names, as they import each other."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_scripts(monkeypatch, *names: str) -> list:
    """``benchmarks/`` on ``sys.path`` for this test (``monkeypatch``) and the modules ``names``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return [importlib.import_module(name) for name in names]
