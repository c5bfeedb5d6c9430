"""The code's layout holds: no import circle inside an app's rooms, no module past the size limit.

The direction between rooms is `lint-imports`' (pyproject.toml, "Rooms inside runs"); a circle
inside one room, or between modules no contract names, is found here.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 700


def circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Every set of modules of `package` that import each other in a ring (Tarjan's components)."""
    modules = sorted(m for m in graph.modules if m.split(".")[0] == package and ".migrations" not in m)
    inside = set(modules)
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in inside) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in edges[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            ring = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                ring.append(member)
                if member == module:
                    break
            if len(ring) > 1:
                found.append(sorted(ring))

    for module in modules:
        if module not in index:
            visit(module)
    return found


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("runs", "agents", "memory", "config")


def test_no_import_circle_inside_runs(graph):
    assert circles(graph, "runs") == []


def test_no_module_is_over_the_size_limit():
    long = [
        str(path.relative_to(ROOT))
        for folder in ("config", "agents", "memory", "runs", "bench")
        for path in (ROOT / folder).rglob("*.py")
        if "migrations" not in path.parts and len(path.read_text().splitlines()) > MAX_LINES
    ]
    assert long == []
