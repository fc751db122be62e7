"""The package's layering: import-linter's contracts (pyproject.toml) hold and no module imports itself back.

Also a script: ``python tests/unit/test_layering.py`` prints every import cycle among ``relax.*`` modules with
its full path and exits 1 when there is one (``make lint`` runs it). Imports under ``if TYPE_CHECKING:`` are
annotations, not dependencies: a cycle that exists only through them is printed as a note, never an error.
Imports inside functions count: deferring an import hides a cycle from Python, not from the design.
See docs/development.md, "Layers".
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections import deque
from itertools import pairwise
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "relax"


def import_graph(*, type_checking: bool = False) -> grimp.ImportGraph:
    """The imports among ``relax.*`` modules; with ``type_checking`` also those under ``if TYPE_CHECKING:``."""
    return grimp.build_graph(PACKAGE, exclude_type_checking_imports=not type_checking, cache_dir=None)


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Components of more than one module (or a module importing itself), each sorted (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.find_modules_directly_imported_by(node):
                    found.append(sorted(component))
    return sorted(found)


def shortest_cycle(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: [m0, m1, ..., m0]."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.find_modules_directly_imported_by(node)):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle of {component}")


def _edge(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    lines = ", ".join(f"l.{d['line_number']}" for d in details)
    return f"{importer} -> {imported} ({lines})"


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    cycle = shortest_cycle(graph, component)
    steps = "\n".join(f"    {_edge(graph, a, b)}" for a, b in pairwise(cycle))
    return f"cycle of {len(component)} modules ({', '.join(component)}); one path:\n{steps}"


def find_cycles() -> tuple[list[str], list[str]]:
    """(cycles of real imports, cycles that exist only through ``if TYPE_CHECKING:`` imports), described."""
    runtime = import_graph()
    real = strongly_connected(runtime)
    full = import_graph(type_checking=True)
    type_only = [c for c in strongly_connected(full) if c not in real]
    return [describe(runtime, c) for c in real], [describe(full, c) for c in type_only]


def run_lint_imports() -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on pyproject.toml's contracts, from the interpreter's own environment."""
    exe = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(exe), "--no-logo", "--no-cache", "pyproject.toml"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_import_contracts_hold() -> None:
    result = run_lint_imports()
    assert result.returncode == 0, (
        "import-linter contracts broken (docs/development.md, 'Layers', says what to do):\n"
        + result.stdout + result.stderr
    )


def test_no_import_cycles() -> None:
    real, type_only = find_cycles()
    for note in type_only:
        warnings.warn(f"only through `if TYPE_CHECKING:` imports: {note}", stacklevel=1)
    assert not real, "import cycles among relax modules:\n" + "\n".join(real)


def test_cycle_finder_reports_the_path() -> None:
    """The finder itself, on a graph with a known cycle and a module outside it."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import x")
    assert strongly_connected(graph) == [["p.a", "p.b", "p.c"]]
    assert shortest_cycle(graph, ["p.a", "p.b", "p.c"]) == ["p.a", "p.b", "p.c", "p.a"]
    assert "p.c -> p.a (l.1)" in describe(graph, ["p.a", "p.b", "p.c"])


def main() -> int:
    real, type_only = find_cycles()
    for note in type_only:
        print(f"note: only through `if TYPE_CHECKING:` imports (not an error): {note}")
    for cycle in real:
        print(f"error: import {cycle}")
    if real:
        print(f"{len(real)} import cycle(s) among {PACKAGE} modules: break each one (docs/development.md, 'Layers')")
        return 1
    print(f"no import cycles among {PACKAGE} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
