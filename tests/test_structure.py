"""The package's structure as the design states it (``docs/architecture.md``): small modules, no
import cycles, one method registry, and ``scpdr.testing`` kept out of library code.

These read the source as text (``ast``): nothing of scpdr is run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scpdr import methods

SRC = Path(__file__).resolve().parents[1] / "src" / "scpdr"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every scpdr module ``name`` imports, at the top or inside a function (a lazy import still
    makes a cycle), resolved to the modules that exist."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            if not t.startswith("scpdr"):
                continue
            # the longest existing module the name refers to
            parts = t.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {n: _imports(n, p) for n, p in MODULES.items()}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first; a package's __init__ importing its
    # own submodules is no cycle, so parents are not added as edges.
    return graph


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name):
    lines = MODULES[name].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it"


def test_no_import_cycle():
    graph = _graph()

    # strongly connected components (Tarjan), ignoring a package __init__ -> its own submodules
    def edges(n: str) -> set[str]:
        return {m for m in graph[n] if not m.startswith(n + ".")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles among scpdr modules: {cycles}"


def test_library_does_not_import_testing():
    offenders = sorted(
        n for n, p in MODULES.items() if n != "scpdr.testing" and "scpdr.testing" in _imports(n, p)
    )
    assert not offenders, f"library modules importing scpdr.testing: {offenders}"


# Result-row names that are no rule name: spelled in scpdr.methods alone (at most one other module).
ROW_ONLY_NAMES = sorted(n for n in methods.SPECS if n not in methods.RULES)


@pytest.mark.parametrize("row", ROW_ONLY_NAMES)
def test_result_row_names_live_in_methods(row):
    spelled = sorted(
        n
        for n, p in MODULES.items()
        if n != "scpdr.methods"
        and (
            f'"{row}"' in p.read_text(encoding="utf-8")
            or f"'{row}'" in p.read_text(encoding="utf-8")
        )
    )
    assert len(spelled) <= 1, f"{row!r} spelled outside scpdr.methods in {spelled}"
