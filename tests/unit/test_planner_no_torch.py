"""``ptdp plan`` is a light command: it imports no torch, and a full search for a 1T-parameter GPT
on 3,072 GPUs costs under a second of CPU time as a whole process. The planner package imports
nothing of torch or the training code, and the trainer reaches the planner only through
:mod:`ptdp.run.planner_report`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ptdp"
FORBIDDEN = (
    "torch",
    "ptdp.engine.step",
    "ptdp.train",
    "ptdp.run",
    "ptdp.commands",
    "ptdp.engine.groups",
    "ptdp.engine.comm",
)


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:  # ``from ptdp import comm``: ptdp.engine.comm too
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def _is_forbidden(name: str) -> bool:
    """torch, the training code (ptdp.engine.step, groups and comm, the run layer, ptdp.train, the commands)."""
    return any(name == f or name.startswith(f + ".") or (f == "ptdp.train" and name.startswith(f)) for f in FORBIDDEN)


def test_planner_package_imports_no_torch_or_training_code():
    for path in sorted((SRC / "planner").glob("*.py")):
        bad = sorted(
            n
            for n in _imported_modules(path)
            if _is_forbidden(n) or n.startswith("ptdp.run.calibration") or n == "ptdp.run.planner_report"
        )
        assert not bad, f"{path.name} imports {bad}"


def test_trainer_reaches_the_planner_through_planner_report_only():
    imported = _imported_modules(SRC / "run" / "trainer.py")
    assert not [n for n in imported if n == "ptdp.planner" or n.startswith("ptdp.planner.")], imported
    assert "ptdp.run.planner_report" in imported
