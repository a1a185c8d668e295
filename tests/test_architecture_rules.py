"""The reader's layers, kept true from the source (``ast``): the format is only the spec.

- ``format/`` does no I/O and imports no OS mechanism: no module there imports fcntl,
  ctypes, mmap, socket, signal, threading, zlib (or select, subprocess,
  multiprocessing), calls ``open()`` or an ``os`` function other than pure path and name
  helpers; and there is no C (or other non-Python) source there.
- Imports go one way: ``format`` <- the mechanisms (``kernels``, then ``files``) <- the
  libraries (``read``, ``sample``, ``store``, ``training``, the connector's engine). A
  module imports nothing from a layer above its own, lazy and type-checking imports
  included (the graph of ``test_import_cycles``).
- Process identity (host name, ``/proc`` facts of a process) is built in one module,
  ``files/identity.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_import_cycles import PACKAGES, all_modules, import_graph

READER = PACKAGES["hidden_state_reader"]
FORMAT = READER / "format"
IDENTITY = READER / "files" / "identity.py"

OS_MECHANISMS = frozenset(
    {"fcntl", "ctypes", "mmap", "socket", "signal", "threading", "zlib"}
    | {"select", "subprocess", "multiprocessing", "_thread", "io", "pathlib", "shutil", "stat"}
)
# What of ``os`` the spec may use: names and paths as strings, never the file system.
OS_PURE = frozenset({"fspath", "getpid", "sep", "PathLike", "path"})
OS_PATH_PURE = frozenset({"join", "basename", "dirname", "split", "splitext", "normpath"})

# Layers, lowest first; a module's layer is that of its longest matching prefix.
LAYERS: dict[str, int] = {
    "hidden_state_reader.errors": 0,
    "hidden_state_reader.format": 1,
    # The measurement seams: a registry of callbacks (imports nothing of ours) that the
    # mechanisms call too (``files/inotify.py``: one probe per inotify event).
    "hidden_state_reader.probes": 2,
    "hidden_state_reader.kernels": 2,
    "hidden_state_reader.files": 3,
}
LIBRARY = 4  # everything else of either package


def layer_of(module: str) -> int:
    """The layer of a dotted module name (``LIBRARY`` unless it lies in a lower one)."""
    found = [
        (len(p), lvl) for p, lvl in LAYERS.items() if module == p or module.startswith(p + ".")
    ]
    return max(found)[1] if found else LIBRARY


def format_sources() -> list[Path]:
    return sorted(FORMAT.rglob("*.py"))


def os_io_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each I/O call or OS-mechanism import in a module's tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OS_MECHANISMS:
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top = (node.module or "").split(".")[0]
            if top in OS_MECHANISMS:
                yield node.lineno, f"from {node.module} import"
            if top == "os":
                for alias in node.names:
                    if alias.name not in OS_PURE:
                        yield node.lineno, f"from os import {alias.name}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "open":
                yield node.lineno, "open()"
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr not in OS_PURE
        ):
            yield node.lineno, f"os.{node.attr}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and (node.value.value.id, node.value.attr) == ("os", "path")
            and node.attr not in OS_PATH_PURE
        ):
            yield node.lineno, f"os.path.{node.attr}"


def test_format_does_no_io_and_imports_no_os_mechanism() -> None:
    found = [
        f"{path.relative_to(READER)}:{line} {what}"
        for path in format_sources()
        for line, what in os_io_uses(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], "format/ is the spec only (move these to files/ or kernels/):\n" + (
        "\n".join(found)
    )


def test_the_check_sees_what_it_forbids() -> None:
    code = (
        "import fcntl\nfrom threading import Lock\nimport os\n"
        "os.pread(0, 1, 0)\nos.path.realpath('x')\nopen('x')\nos.path.join('a', 'b')\n"
    )
    found = sorted(what for _, what in os_io_uses(ast.parse(code)))
    assert found == sorted(
        [
            "import fcntl",
            "from threading import",
            "os.pread",
            "os.path.realpath",
            "open()",
        ]
    )


def test_no_c_or_other_native_source_in_format() -> None:
    others = sorted(
        str(p.relative_to(READER))
        for p in FORMAT.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    )
    assert others == [], f"only Python spec modules belong in format/: {others}"


def test_imports_go_from_the_format_up_through_the_mechanisms_to_the_libraries() -> None:
    graph = import_graph(all_modules())
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(module) < LIBRARY and layer_of(target) > layer_of(module)
    )
    assert upward == [], "imports against the layer order format <- kernels <- files:\n" + (
        "\n".join(upward)
    )


def test_layers_are_where_the_rule_says() -> None:
    assert layer_of("hidden_state_reader.format.names") == 1
    assert layer_of("hidden_state_reader.files.identity") == 3
    assert layer_of("hidden_state_reader.read.claims") == LIBRARY
    assert layer_of("hidden_state_connector.engine.worker_side") == LIBRARY
    graph = import_graph(all_modules())
    # Each mechanism is used from above: the rule has something to hold.
    assert "hidden_state_reader.files.locks" in graph["hidden_state_reader.read.claims"]
    assert "hidden_state_reader.kernels.crc" in graph["hidden_state_reader.files.publish"]


def identity_builders(tree: ast.AST) -> Iterator[int]:
    """Lines that ask the OS who a process is: ``gethostname``, ``/proc`` process facts."""
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name == "gethostname":
            yield node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if ("boot_id" in text and "/" in text) or text.startswith("/proc/") or "ns/pid" in text:
                yield node.lineno
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if text.startswith("/proc/") or text.endswith("/stat"):
                yield node.lineno


def test_process_identity_is_built_in_one_module() -> None:
    found = []
    for directory in PACKAGES.values():
        for path in sorted(directory.rglob("*.py")):
            if path == IDENTITY:
                continue
            lines = list(identity_builders(ast.parse(path.read_text(), str(path))))
            found += [f"{path.relative_to(directory.parent)}:{line}" for line in lines]
    assert found == [], "build process identity through files/identity.py:\n" + "\n".join(found)
    assert list(identity_builders(ast.parse(IDENTITY.read_text())))  # the home does


def test_a_sample_observation_is_built_in_one_function() -> None:
    states = READER / "sample" / "states.py"
    found = []
    for directory in PACKAGES.values():
        for path in sorted(directory.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "Observation"
                    and path != states
                ):
                    found.append(f"{path.relative_to(directory.parent)}:{node.lineno}")
    assert found == [], "build observations with sample.states.observe:\n" + "\n".join(found)
