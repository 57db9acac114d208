"""The scripts of ``benchmarks/`` imported by their plain names, as they import each other."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_scripts(monkeypatch, *names: str) -> list:
    """``benchmarks/`` on ``sys.path`` for this test (``monkeypatch``) and the modules ``names``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return [importlib.import_module(name) for name in names]


def load_script(name: str):
    """The module ``benchmarks/<name>.py``, with ``benchmarks/`` put on ``sys.path`` for the rest of
    the process (for gloo workers, which have no ``monkeypatch``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
