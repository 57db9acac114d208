"""The package's import graph: layers import only layers below them, and nothing imports in a
circle, whether at module level, inside a function or for type checking."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import ptdp

SRC = Path(ptdp.__file__).resolve().parent

#: each top-level part of ptdp and its layer: a module imports only lower layers (and its own part);
#: parts on one layer do not import each other
LAYERS = {
    "ptdp.errors": 0,
    "ptdp.layout": 1,
    "ptdp.config": 2,
    "ptdp.topology": 3,
    "ptdp.data": 3,
    "ptdp.engine": 4,
    "ptdp.planner": 4,
    "ptdp.run": 5,
    "ptdp.commands": 6,
    "ptdp.api": 7,
    "ptdp.cli": 8,
    "ptdp.train": 8,
    "ptdp": 9,
}


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ["ptdp", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the ptdp modules it imports anywhere in its text (``from P import m`` of a
    submodule ``m`` counts as importing ``P.m``)."""
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names
                ]
            else:
                continue
            graph[name].update(t for t in targets if t.split(".")[0] == "ptdp" and t != name)
    return graph


def part(module: str) -> str:
    return module if module == "ptdp" else ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_every_part_of_the_package_has_a_layer():
    assert {part(m) for m in modules()} <= set(LAYERS)
    assert "ptdp.spec" not in {part(m) for m in modules()}


def test_imports_go_down_the_layers():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if part(a) != part(b) and LAYERS[part(b)] >= LAYERS[part(a)]
    )
    assert upward == []


def test_no_import_cycle_between_modules_or_folders():
    graph = import_graph()
    assert cycles(graph) == []
    for depth in (2, 3, 4):
        folders: dict[str, set[str]] = defaultdict(set)
        for a, targets in graph.items():
            for b in targets:
                fa, fb = ".".join(a.split(".")[:depth]), ".".join(b.split(".")[:depth])
                if fa != fb and not fb.startswith(fa + ".") and not fa.startswith(fb + "."):
                    folders[fa].add(fb)
        assert cycles(folders) == [], depth


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, also under
    ``if``/``try``)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse
    return names


def test_every_import_names_the_module_that_defines_the_name():
    """No module re-exports a name it imports: ``from ptdp.X import name`` finds ``name`` defined
    in ``ptdp.X`` (or ``ptdp.X.name`` is a module); the package face ``ptdp`` aside."""
    mods = modules()
    defined = {name: _defined(path) for name, path in mods.items()}
    borrowed = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods):
                continue
            if node.module == "ptdp":
                continue
            borrowed += [
                f"{name}: {a.name} from {node.module}"
                for a in node.names
                if f"{node.module}.{a.name}" not in mods and a.name not in defined[node.module]
            ]
    assert borrowed == []
