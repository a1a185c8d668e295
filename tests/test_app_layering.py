"""The applications sit on top of the libraries (docs/contributing.md, "Code layout").

Applications are the modules under ``hidden_state_reader.apps`` and
``hidden_state_connector.apps`` (the ``hidden-state`` command, export, extract, the demo,
the ``vllm serve`` launcher, the tiny models), imported from there: no alias module
outside ``apps`` re-exports one. Everything else in the packages is library. Checked
from the source (``ast``), lazy imports included:

- library modules never import ``argparse`` or any application module;
- the old alias paths (``hidden_state_connector.server``, ``.tiny_model``,
  ``hidden_state_reader.export``) are gone, and nothing imports them;
- one ``parse_size`` and one progress-reporter class in the packages;
- nothing outside the applications (library, examples, benchmarks, tools) imports the demo;
- benchmarks assign to no attribute of a library module or class (no monkey-patching):
  they hook in through ``hidden_state_reader.probes`` and injected factories
  (``test_benchmark_seams`` extends this to instance attributes and private reads).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_import_cycles import ROOT, all_modules, import_graph

APPS = ("hidden_state_reader.apps", "hidden_state_connector.apps")
REMOVED_ALIASES = (
    "hidden_state_connector.server",
    "hidden_state_connector.tiny_model",
    "hidden_state_reader.export",
)
DEMO = "hidden_state_connector.apps.demo"
LIBRARIES = ("hidden_state_reader", "hidden_state_connector")


def is_app(module: str) -> bool:
    """Whether ``module`` is an application (under ``apps``)."""
    return any(module == a or module.startswith(a + ".") for a in APPS)


def imported_names(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every module name an ``import`` names (``from m import x``: ``m`` and ``m.x``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_library_modules_import_no_argparse_and_no_application() -> None:
    known = all_modules()
    graph = import_graph(known)
    assert "hidden_state_connector.apps.cli.serve" in known and is_app(DEMO)
    bad = []
    for name, (path, _) in known.items():
        if is_app(name) or path.suffix != ".py":
            continue
        bad += [f"{name} imports {t}" for t in sorted(graph[name]) if is_app(t)]
        tree = ast.parse(path.read_text(), str(path))
        bad += [f"{name}:{line} imports {m}" for m, line in imported_names(tree) if m == "argparse"]
    assert bad == [], "\n".join(bad)


def test_applications_are_imported_from_apps_only() -> None:
    known = all_modules()

    def removed(module: str) -> bool:
        return any(module == a or module.startswith(a + ".") for a in REMOVED_ALIASES)

    assert [m for m in known if removed(m)] == []
    bad = []
    for path in python_files("packages", "examples", "benchmarks", "tools", "tests"):
        for module, line in imported_names(ast.parse(path.read_text(), str(path))):
            if removed(module):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == [], "import applications from apps:\n" + "\n".join(bad)


def definitions(kind: type, predicate: object) -> list[str]:
    found = []
    for path in python_files("packages"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kind) and predicate(node.name):  # type: ignore[attr-defined, operator]
                found.append(f"{path.relative_to(ROOT)}:{node.name}")  # type: ignore[attr-defined]
    return found


def test_one_parse_size_and_one_progress_reporter() -> None:
    parse_size = definitions(ast.FunctionDef, lambda n: n == "parse_size")
    assert parse_size == ["packages/reader/src/hidden_state_reader/sizes.py:parse_size"]
    progress = definitions(ast.ClassDef, lambda n: "progress" in n.lower())
    assert progress == [
        "packages/reader/src/hidden_state_reader/apps/cli/progress.py:ProgressReporter"
    ]


def test_nothing_outside_the_applications_imports_the_demo() -> None:
    known = all_modules()
    outside = [p for n, (p, _) in known.items() if not is_app(n) and p.suffix == ".py"]
    outside += python_files("examples", "benchmarks", "tools")
    bad = []
    for path in outside:
        for module, line in imported_names(ast.parse(path.read_text(), str(path))):
            if module == DEMO or module.startswith(DEMO + "."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == [], "\n".join(bad)


def library_bindings(tree: ast.AST) -> set[str]:
    """Local names bound to a library module or a name imported from one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def patches(source: str) -> list[str]:
    """Assignments to (and ``setattr`` on) attributes of library modules and classes."""
    tree = ast.parse(source)
    bound = library_bindings(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
        for target in targets:
            for sub in stored(target):
                base = sub.value
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bound:
                    found.append(f"{getattr(node, 'lineno', '?')}: {ast.unparse(sub)}")
    return found


def stored(target: ast.expr) -> Iterator[ast.Attribute | ast.Subscript]:
    """What an assignment target writes into: attributes and items, tuples unpacked."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from stored(element)
    elif isinstance(target, ast.Starred):
        yield from stored(target.value)
    elif isinstance(target, (ast.Attribute, ast.Subscript)):
        yield target


def test_the_patch_finder_finds_patches() -> None:
    source = (
        "from hidden_state_reader.files import inotify as discovery\n"
        "import hidden_state_reader.store.load\n"
        "from hidden_state_connector.engine.sinks.mooncake import StoreLock\n"
        "discovery.Inotify.dispatch = None\n"
        "hidden_state_reader.store.load.crc32 += 1\n"
        "setattr(StoreLock, 'release', None)\n"
        "from hidden_state_reader.format import crc\n"
        "crc.IMPLEMENTATIONS['x'], y = None, 1\n"
        "local = object(); local.x = 1\n"
        "table = {}; table[crc.crc32] = 1\n"
    )
    assert sorted(p.split(": ")[1] for p in patches(source)) == [
        "StoreLock.?",
        "crc.IMPLEMENTATIONS['x']",
        "discovery.Inotify.dispatch",
        "hidden_state_reader.store.load.crc32",
    ]


def test_benchmarks_patch_no_library_attribute() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{found}"
        for path in python_files("benchmarks")
        for found in patches(path.read_text())
    ]
    assert bad == [], "\n".join(bad)
