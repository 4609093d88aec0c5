"""No import cycles between the package's modules (issue 27): every import counted, also the
ones inside functions, except those under ``if TYPE_CHECKING:`` (never run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tensorverse"

# An optional extra picked at run time: `make_executor` imports the Ray executor only when asked
# for it (and Ray is installed); the Ray executor builds on the executor protocol.
ALLOWED = {frozenset({"tensorverse.matrix.executor", "tensorverse.matrix.ray_executor"})}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(tree: ast.AST, mods: dict[str, Path]) -> set[str]:
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tensorverse"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
            out.update(subs or ({node.module} & set(mods)))
        elif isinstance(node, ast.Import):
            out.update({a.name for a in node.names} & set(mods))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        graph[name] |= _imports(ast.parse(path.read_text(encoding="utf-8")), mods) - {name}
    cycles = [c for c in _cycles(graph) if frozenset(c) not in ALLOWED]
    assert cycles == [], cycles


def test_the_check_finds_a_cycle():
    graph = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(graph) == [{"a", "b", "c"}]
