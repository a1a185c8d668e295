"""The engine seam (issue 43), kept true from the source (``ast``).

- One factory, ``engine/engines.py``, reads ``capture`` and ``storage_backend``; only
  the settings themselves (``config.py``, ``store_config.py``: parsing and checking the
  keys) name them elsewhere.
- The facade (``connector.py``), the two halves and the shared engine modules import no
  capture engine (``engine/extract``, ``engine/forward``) and no medium (``engine/sinks``):
  they reach them through ``engine/seam.py``'s interfaces, built by the factory.
- One ``WorkerSide`` and one ``SchedulerSide``: nothing subclasses them.
- The capture engines and the media are siblings: none imports another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_import_cycles import PACKAGES, ROOT, all_modules, import_graph

CONNECTOR = PACKAGES["hidden_state_connector"]
ENGINE = CONNECTOR / "engine"
FACTORY = ENGINE / "engines.py"
SETTINGS = {ENGINE / "config.py", ENGINE / "store_config.py"}
APPS = CONNECTOR / "apps"
PARTS = ("extract", "forward", "sinks")  # engine/<part>/: what the factory picks from
ENGINE_PKG = "hidden_state_connector.engine"
HALVES = ("WorkerSide", "SchedulerSide")
# Imports of an engine part that are not the factory's, each with why:
PART_IMPORTS_ELSEWHERE = {
    # vLLM's plugin hook, loaded in every process before any connector exists: forward
    # capture must hook the model while vLLM builds it (its install module asks the
    # factory whether the engine's capture does).
    ("hidden_state_connector.plugin", f"{ENGINE_PKG}.forward.install"),
}


def library_sources() -> Iterator[tuple[Path, ast.AST]]:
    """The connector's library modules (the applications build configs; not checked)."""
    for path in sorted(CONNECTOR.rglob("*.py")):
        if APPS not in path.parents:
            yield path, ast.parse(path.read_text(), str(path))


def setting_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each read of ``<...>config.capture``, ``.storage_backend`` or
    a ``CAPTURE_*`` constant."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "storage_backend":
            yield node.lineno, ".storage_backend"
        elif isinstance(node, ast.Attribute) and node.attr == "capture":
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name.endswith("config"):
                yield node.lineno, f"{name}.capture"
        elif isinstance(node, ast.Name) and node.id.startswith("CAPTURE_"):
            yield node.lineno, node.id


def test_only_the_factory_reads_capture_and_storage_backend() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path, tree in library_sources()
        if path != FACTORY and path not in SETTINGS
        for line, what in setting_reads(tree)
    ]
    assert found == [], "pick the engine or medium in engine/engines.py only:\n" + "\n".join(found)


def _part_of(module: str) -> str | None:
    """The engine part (``extract``, ``forward``, ``sinks``) a module lies in, if any."""
    for part in PARTS:
        prefix = f"{ENGINE_PKG}.{part}"
        if module == prefix or module.startswith(prefix + "."):
            return part
    return None


def test_only_the_factory_imports_the_engines_and_media() -> None:
    graph = import_graph(all_modules())
    factory = f"{ENGINE_PKG}.engines"
    found = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("hidden_state_connector.")
        and not module.startswith("hidden_state_connector.apps.")
        and module != factory
        and _part_of(module) is None
        for target in targets
        if _part_of(target) is not None and (module, target) not in PART_IMPORTS_ELSEWHERE
    )
    assert found == [], "reach the engines and media through engine/seam.py:\n" + "\n".join(found)


def test_engines_and_media_are_siblings() -> None:
    graph = import_graph(all_modules())
    found = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _part_of(module) is not None
        for target in targets
        if _part_of(target) not in (None, _part_of(module))
    )
    assert found == [], "an engine or medium imports another:\n" + "\n".join(found)


def test_one_worker_side_and_one_scheduler_side() -> None:
    found = []
    for directory in [*PACKAGES.values(), ROOT / "benchmarks", ROOT / "tests"]:
        for path in sorted(directory.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = {getattr(b, "attr", getattr(b, "id", "")) for b in node.bases}
                    if bases & set(HALVES):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == [], "give the engine part a seam method instead:\n" + "\n".join(found)


def test_the_facade_builds_the_halves_through_the_factory() -> None:
    tree = ast.parse((CONNECTOR / "connector.py").read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in imported if _part_of(m) is not None}
    assert f"{ENGINE_PKG}" in imported  # ``from ...engine import compat, engines``


def test_the_finders_see_what_they_forbid() -> None:
    code = (
        "if config.capture == CAPTURE_FORWARD: pass\n"
        "if self.config.storage_backend == 'files': pass\n"
        "self.capture.metadata()\n"
        "class A(WorkerSide): pass\n"
    )
    tree = ast.parse(code)
    assert sorted(line for line, _ in setting_reads(tree)) == [1, 1, 2]
    assert _part_of("hidden_state_connector.engine.forward.rows") == "forward"
    assert _part_of("hidden_state_connector.engine.seam") is None
