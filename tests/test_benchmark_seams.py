"""Benchmarks and examples use the libraries through documented seams, never their internals.

Checked from the source (``ast``) of ``benchmarks/`` and ``examples/``. A *library object*
is a library module, class or function imported there, anything derived from one (a call,
an attribute, an item, a ``for`` or ``with`` target, a parameter annotated with a library
type, a name or ``self.attribute`` assigned one of those), and ``self`` inside a subclass of
a library class. Such code:

- reads no private attribute of a library object (``x._name`` or ``getattr(x, "_name")``;
  dunders are fine) and imports no private name from a library;
- assigns to no attribute of a library object (``pipeline._write = ...``,
  ``extractor.copy = ...``, ``setattr``/``delattr`` on one), instance attributes included;
- overrides no private method in a subclass of a library class.

The seams to use instead: ``hidden_state_reader.probes``, constructor arguments and
injected factories (``WritePipeline(writer_factory=...)``, an ``Extractor`` subclass handed
to ``WritePipeline``), ``HiddenStateConnector.sample_writer``, and public read-only
accessors (``HiddenStateReader.watch_counters``). ``test_app_layering`` keeps the older
rule: no assignment into library modules and classes (their items included).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_app_layering import LIBRARIES, library_bindings, python_files
from test_import_cycles import ROOT

SEAMS = (
    "a documented seam: hidden_state_reader.probes, a constructor argument or injected "
    "factory, a public accessor"
)
# What to use instead, for the reach-ins this rule was written against.
HINTS = {
    "_write": "HiddenStateConnector.sample_writer (a subclass sets its own)",
    "_worker": "HiddenStateConnector.sample_writer (a subclass sets its own)",
    "_backend": "HiddenStateReader.watch_counters",
    "_known": "HiddenStateReader.watch_counters (its tracked count)",
    "copy": "an Extractor subclass handed to WritePipeline",
    "chunk_nonfinite": "an Extractor subclass handed to WritePipeline",
    "file_options": "WritePipeline(writer_factory=...)",
}


def is_private(name: str) -> bool:
    """``_name`` but not ``__dunder__``."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def annotation_names(node: ast.expr | None) -> Iterator[str]:
    """The names an annotation mentions (string annotations parsed)."""
    if node is None:
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id


class Tracker:
    """Which names, ``self.attribute`` paths and classes of one file hold library objects.

    Name-based and file-wide (a name bound to a library object anywhere counts
    everywhere), except ``self``, which is a library object only in the methods of a
    subclass of a library class.
    """

    def __init__(self, tree: ast.Module) -> None:
        self.names = library_bindings(tree)
        self.library_classes: set[ast.ClassDef] = set()
        self.self_is_library: dict[ast.AST, bool] = {}
        while True:  # to a fixed point: a binding can make an earlier one a library object
            before = (len(self.names), len(self.library_classes))
            self._visit(tree, False)
            if (len(self.names), len(self.library_classes)) == before:
                return

    def holds(self, node: ast.expr | None, self_library: bool) -> bool:
        """Whether ``node`` evaluates to a library object."""
        if node is None:
            return False
        if isinstance(node, ast.Name) and node.id == "self":
            return self_library
        path = dotted(node)
        if path is not None:
            parts = path.split(".")
            if any(".".join(parts[: i + 1]) in self.names for i in range(len(parts))):
                return True
            if parts[0] == "self" and self_library:
                return True
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred, ast.Await)):
            return self.holds(node.value, self_library)
        if isinstance(node, ast.Call):
            return self.holds(node.func, self_library)
        if isinstance(node, ast.IfExp):
            return self.holds(node.body, self_library) or self.holds(node.orelse, self_library)
        if isinstance(node, ast.BoolOp):
            return any(self.holds(v, self_library) for v in node.values)
        if isinstance(node, ast.NamedExpr):
            return self.holds(node.value, self_library)
        return False

    def _bind(self, target: ast.expr, value: ast.expr | None, self_library: bool) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts, strict=True):
                    self._bind(t, v, self_library)
            else:
                for t in target.elts:
                    self._bind(t, value, self_library)
            return
        if isinstance(target, ast.Starred):
            self._bind(target.value, value, self_library)
            return
        path = dotted(target)
        if path is not None and self.holds(value, self_library):
            self.names.add(path)

    def _library_annotation(self, node: ast.arg) -> bool:
        """A parameter (not ``self``) annotated with a library type."""
        names = annotation_names(node.annotation)
        return node.arg != "self" and any(n in self.names for n in names)

    def _visit(self, node: ast.AST, self_library: bool) -> None:
        self.self_is_library[node] = self_library
        if isinstance(node, ast.ClassDef):
            if any(self.holds(b, False) for b in node.bases):
                self.library_classes.add(node)
                self.names.add(node.name)
            self_library = node in self.library_classes
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(target, node.value, self_library)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            self._bind(node.target, node.value, self_library)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind(node.target, node.iter, self_library)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind(node.optional_vars, node.context_expr, self_library)
        elif isinstance(node, ast.arg) and self._library_annotation(node):
            self.names.add(node.arg)
        for child in ast.iter_child_nodes(node):
            self._visit(child, self_library)


def reach_ins(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each reach into a library object's internals in ``source``."""
    tree = ast.parse(source)
    lib = Tracker(tree)
    found: list[tuple[int, str]] = []

    def hint(attr: str) -> str:
        return HINTS.get(attr, SEAMS)

    for node in ast.walk(tree):
        self_library = lib.self_is_library.get(node, False)
        if isinstance(node, ast.Attribute) and lib.holds(node.value, self_library):
            text = ast.unparse(node)
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append((node.lineno, f"assigns {text}; use {hint(node.attr)}"))
            elif is_private(node.attr):
                found.append((node.lineno, f"reads private {text}; use {hint(node.attr)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            name, owner = node.func.id, node.args[0]
            if name in ("setattr", "delattr") and lib.holds(owner, self_library):
                found.append((node.lineno, f"{name} on {ast.unparse(owner)}; use {SEAMS}"))
            attr = node.args[1] if len(node.args) > 1 else None
            if (
                name in ("getattr", "hasattr")
                and isinstance(attr, ast.Constant)
                and isinstance(attr.value, str)
                and is_private(attr.value)
                and lib.holds(owner, self_library)
            ):
                text = ast.unparse(node)
                found.append((node.lineno, f"reads private {text}; use {hint(attr.value)}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            for part in filter(is_private, parts):
                found.append((node.lineno, f"imports private {part} from {node.module}"))
        elif isinstance(node, ast.ClassDef) and node in lib.library_classes:
            methods = [
                n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            for item in filter(lambda m: is_private(m.name), methods):
                where = f"{node.name}.{item.name}"
                found.append((item.lineno, f"overrides private {where}; use {SEAMS}"))
    return sorted(set(found))


def test_the_reach_in_finder_finds_reach_ins() -> None:
    source = (
        "from hidden_state_reader import HiddenStateReader\n"
        "from hidden_state_connector.connector import HiddenStateConnector\n"
        "from hidden_state_connector.engine.write.pipeline import WritePipeline\n"
        "from hidden_state_reader.read import _private\n"
        "reader = HiddenStateReader('d')\n"
        "source = reader._backend.source\n"  # 6: a private read
        "n = len(getattr(source, '_known', ()))\n"  # 7: getattr of a private name
        "class C(HiddenStateConnector):\n"
        "    def register_kv_caches(self, caches):\n"
        "        worker = self._worker\n"  # 10: a private read through self
        "        pipeline = worker.pipeline\n"
        "        pipeline.extractor.copy = print\n"  # 12: an instance attribute assigned
        "    def _start(self): pass\n"  # 13: a private method overridden
        "def f(p: WritePipeline) -> None:\n"
        "    setattr(p, 'x', 1)\n"  # 15
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self.pipeline = WritePipeline(None)\n"
        "        self._own = 1\n"  # fine: a benchmark's own object
        "        self.pipeline.file_options = None\n"  # 20
        "        print(reader.__class__, reader.stats.yielded, self._own)\n"  # fine
    )
    lines = [line for line, _ in reach_ins(source)]
    assert lines == [4, 6, 7, 10, 12, 13, 15, 20], reach_ins(source)
    assert "HiddenStateReader.watch_counters" in dict(reach_ins(source))[6]


def checked_files() -> list[Path]:
    return python_files("benchmarks", "examples")


def test_benchmarks_and_examples_use_no_library_internals() -> None:
    files = checked_files()
    assert any(p.name == "null_sink.py" for p in files)
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        for line, what in reach_ins(path.read_text())
    ]
    assert bad == [], "\n".join(bad)
