"""The package's shape: no import cycles in ``src/prefixgate`` or ``benchmarks``.

Every import counts: module level, function-local (lazy) and under ``if TYPE_CHECKING:``. An
edge goes to the module an import names: ``from .x import y`` is an edge to ``x`` (or to
``x.y`` when that is a submodule), ``from . import y`` to the submodule ``y`` (or, when ``y`` is
not one, to the package's ``__init__``). Importing a submodule does not add an edge to the
packages above it: Python runs their ``__init__`` first, but that is the package's front door
re-exporting its parts, not a dependency of the part. A module that imports its own package's
front door (``from prefixgate import X``) does get an edge to ``__init__``, which imports
everything: that is how such an import closes a cycle, and the test reports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package at ``package_dir``, by dotted name (``pkg.sub.mod``;
    a package by its own name, for its ``__init__.py``)."""
    base = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module ``name`` stands for: itself, or the longest known module it is inside of
    (``pkg.mod.attr`` is ``pkg.mod``); ``None`` outside the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other modules in ``modules``, found anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from base import y`: y may be a submodule (an edge to it) or a name in base.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    edges.add(resolved)
        graph[name] = edges
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path that starts and ends at the same node, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        state[start] = 1
        stack = [iter(sorted(graph.get(start, ())))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_reports_the_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2", "c"}, "b2": set(), "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"x": {"y"}, "y": set(), "p": {"q"}, "q": {"p"}}) == ["p", "q", "p"]


def test_import_graph_counts_lazy_type_checking_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\nfrom .b import B\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    import pkg.sub.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import A\nfrom ..a import A\n")
    graph = import_graph(module_files(pkg))
    assert graph == {"pkg": {"pkg.a", "pkg.b"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.sub.c"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg", "pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


@pytest.mark.parametrize("package", ["src/prefixgate", "benchmarks"])
def test_no_import_cycles(package):
    modules = module_files(ROOT / package)
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle or ())}"


def test_no_module_imports_the_package_front_door_and_the_stream_knows_no_gateway():
    graph = import_graph(module_files(ROOT / "src/prefixgate"))
    assert [m for m, edges in graph.items() if "prefixgate" in edges] == []
    assert not graph["prefixgate.streaming"] & {"prefixgate.gateway", "prefixgate.dispatch"}
