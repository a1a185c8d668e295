"""No import circles in either package, lazy and type-checking imports included.

The graph is built from the source (``ast``): every ``import`` and ``from ... import``
anywhere in a module, inside functions and ``if TYPE_CHECKING:`` blocks too, is an edge
to the module it names (``from pkg import name`` names ``pkg.name`` when that is a
module, else ``pkg``). C extension modules (``*.c`` beside the Python files, such as
``kernels/_fp8_native.c``) are modules too, importing none of ours. A circle is a
strongly connected component of more than one module: each of them imports itself
through the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "hidden_state_reader": ROOT / "packages/reader/src/hidden_state_reader",
    "hidden_state_connector": ROOT / "packages/connector/src/hidden_state_connector",
}


def modules(package: str, directory: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out = {}
    for path in sorted([*directory.rglob("*.py"), *directory.rglob("*.c")]):
        parts = [package, *path.relative_to(directory).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(known: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``known`` it imports anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        if path.suffix != ".py":  # an extension module's C source imports none of ours
            graph[name] = targets
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in known:
                        targets.add(sub)
                    elif base in known:
                        targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def all_modules() -> dict[str, tuple[Path, bool]]:
    known: dict[str, tuple[Path, bool]] = {}
    for package, directory in PACKAGES.items():
        known.update(modules(package, directory))
    return known


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph(all_modules())
    # A function-level import (the store backend, opened only for mooncake:// paths).
    assert "hidden_state_reader.store.backend" in graph["hidden_state_reader.reader"]
    # An import under ``if TYPE_CHECKING:`` (the package's lazily exported names).
    assert "hidden_state_reader.reader" in graph["hidden_state_reader"]
    # A C extension is a module (so importing it is not importing its package).
    assert graph["hidden_state_reader.kernels.fp8_cpu"] >= {
        "hidden_state_reader.kernels._fp8_native"
    }
    assert "hidden_state_reader.format" not in graph["hidden_state_reader.kernels.fp8_cpu"]
    # And the circle finder, on a graph with one circle and a module outside it.
    cycle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(cycle) == [frozenset({"a", "b", "c"})]


def test_no_import_circles() -> None:
    found = [sorted(c) for c in circles(import_graph(all_modules()))]
    assert found == [], f"import circles: {found}"


def test_applications_sit_above_the_libraries() -> None:
    # Layers: library <- applications (``apps`` packages; tests/test_app_layering.py
    # checks the rest of the layering). Contracted to two nodes, the graph has no circle.
    def layer(module: str) -> str:
        return "apps" if ".apps" in module else "library"

    graph = import_graph(all_modules())
    layers: dict[str, set[str]] = {"apps": set(), "library": set()}
    for module, targets in graph.items():
        layers[layer(module)].update(layer(t) for t in targets if layer(t) != layer(module))
    assert layers == {"apps": {"library"}, "library": set()}
    assert circles(layers) == []
