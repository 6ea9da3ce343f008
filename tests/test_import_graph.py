"""The package's import graph: no circle, and every import points down the data flow of
DESIGN.md (commands -> serve-check -> train -> compare -> judging -> cases / sides -> diagnosis -> checks ->
replay -> the audit's vocabulary -> reference source / profile -> data -> model). Imports
inside functions count: a function-level import that climbs is still a circle waiting.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_audit"

#: Rank of each module prefix (the longest matching prefix wins): a module may import
#: modules of its own rank or lower, never higher.
RANKS: dict[str, int] = {
    "dflash_audit.cli": 100,
    "dflash_audit.command_errors": 100,
    "dflash_audit.audit.compare_cli": 100,
    "dflash_audit.train.commands": 100,
    "dflash_audit.serve": 95,
    "dflash_audit.train": 90,
    "dflash_audit.batch_audit": 85,
    "dflash_audit.audit.compare": 80,
    "dflash_audit.audit.judge": 75,
    "dflash_audit.audit.sides": 70,
    "dflash_audit.audit.cases": 70,
    "dflash_audit.audit.frameworks": 70,
    "dflash_audit.audit.diagnose": 60,
    "dflash_audit.audit.checks": 55,
    "dflash_audit.audit.replay": 50,
    "dflash_audit.candidate": 45,
    "dflash_audit.report": 45,
    "dflash_audit.audit": 40,
    "dflash_audit.reference_source": 30,
    "dflash_audit.profile": 30,
    "dflash_audit.profile_import": 30,
    "dflash_audit.data": 20,
    "dflash_audit.model": 10,
    "dflash_audit.data.errors": 0,
    "dflash_audit.atomic": 0,
    "dflash_audit.progress": 0,
    "dflash_audit": 0,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (``from X import Y`` counts
    ``X.Y`` when that is a module, else ``X``)."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [t for t in (f"{base}.{a.name}" for a in node.names) if t in MODULES]
            found.update(targets or ([base] if base in MODULES else []))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def rank(module: str) -> int:
    """The rank of the longest prefix of ``module`` in :data:`RANKS`."""
    prefixes = [p for p in RANKS if module == p or module.startswith(p + ".")]
    return RANKS[max(prefixes, key=len)]


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    """The parser sees the imports it must judge (a test that reads no edge cannot fail)."""
    assert "dflash_audit.audit.cases.plan" in GRAPH["dflash_audit.audit.compare"] or any(
        m.startswith("dflash_audit.audit.cases") for m in GRAPH["dflash_audit.audit.compare"])
    assert "dflash_audit.model.config" in GRAPH["dflash_audit.audit.case"]
    assert sum(map(len, GRAPH.values())) > 200


def test_no_import_circle():
    assert _cycles() == []


def test_imports_point_down():
    upward = sorted(f"{a} ({rank(a)}) imports {b} ({rank(b)})" for a, targets in GRAPH.items()
                    for b in targets if rank(b) > rank(a))
    assert upward == []


@pytest.mark.parametrize("layer", ["dflash_audit.audit", "dflash_audit.data",
                                   "dflash_audit.model"])
def test_nothing_below_train_imports_train(layer):
    offenders = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith(layer)
                       for b in targets if b.startswith("dflash_audit.train"))
    assert offenders == []


def test_no_module_over_400_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}


def test_the_checker_catches_a_circle_and_a_climb(monkeypatch):
    """The two rules fail on a graph that breaks them."""
    monkeypatch.setitem(GRAPH, "dflash_audit.model.config",
                        GRAPH["dflash_audit.model.config"] | {"dflash_audit.audit.case"})
    assert any("dflash_audit.model.config" in c for c in _cycles())
    assert rank("dflash_audit.audit.case") > rank("dflash_audit.model.config")
