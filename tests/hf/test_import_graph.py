"""No import circles inside the planner, the options or slide-core's checkpoint package.

A circle there once hid which module owned a rule (the planner's memory, timing and unit costs each read the
others' helpers), and it makes a module's import order matter. Every import a module makes at run time counts,
those inside functions too; imports under ``if TYPE_CHECKING:`` are for the type checker alone and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2] / "packages"
PACKAGES = {
    "slide_hf.planner": _ROOT / "slide-hf/src/slide_hf/planner",
    "slide_hf.options": _ROOT / "slide-hf/src/slide_hf/options",
    "slide_core.checkpoint": _ROOT / "slide-core/src/slide_core/checkpoint",
}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    kept: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        kept.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return kept


def _imports(package: str, path: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at run time (the package itself excluded)."""
    graph: dict[str, set[str]] = {}
    for source in sorted(path.glob("*.py")):
        if source.stem == "__init__":
            continue
        module = f"{package}.{source.stem}"
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = f"{package}.{node.module}" if node.level == 1 and node.module else (node.module or "")
                if node.level == 1 and not node.module:
                    found.update(f"{package}.{alias.name}" for alias in node.names)
                elif base.startswith(f"{package}."):
                    found.add(base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith(f"{package}."))
        graph[module] = found - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle, as the path that closes it (a depth-first walk from each module)."""
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for following in sorted(graph.get(path[-1], ())):
            if following in path:
                found.append([*path[path.index(following) :], following])
            elif len(path) < len(graph):
                walk([*path, following])

    for module in sorted(graph):
        walk([module])
    return found


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_circles(package: str) -> None:
    graph = _imports(package, PACKAGES[package])
    assert graph, f"no modules found for {package}"
    circles = _circles(graph)
    assert not circles, f"{package} imports in a circle: " + "; ".join(" -> ".join(c) for c in circles[:3])


def test_the_checker_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"], ["b", "a", "b"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
