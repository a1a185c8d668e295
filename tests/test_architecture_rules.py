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

from test_import_cycles import PACKAGES, ROOT, all_modules, import_graph

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
    # Producers on threads and their bounded queues: imports nothing of ours, and both
    # packages' libraries use it.
    "hidden_state_reader.stages": 2,
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


MUTATORS = frozenset(
    {"clear", "append", "add", "update", "pop", "popitem", "setdefault", "remove", "discard"}
    | {"extend", "insert", "appendleft", "popleft"}
)
# Process state still in format/, left for now (named in issue 43's report):
FORMAT_STATE_LEFT = {"header.py:_LAYER_IDS"}  # SampleHeader.layer_ids' memo (64 entries)


def process_state(tree: ast.Module) -> Iterator[str]:
    """Module-level names a module changes at run time: ``global`` rebinding, item
    assignment or a mutating method call (``clear``, ``append``, ``setdefault``, ...)."""
    names = {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield from (n for n in node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and _name(t.value) in names:
                    yield str(_name(t.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in names
        ):
            yield node.func.value.id


def test_format_keeps_no_process_state() -> None:
    found = {
        f"{path.name}:{name}"
        for path in format_sources()
        for name in process_state(ast.parse(path.read_text(), str(path)))
    }
    assert found - FORMAT_STATE_LEFT == set(), (
        "format/ is the spec only: caches and other process state belong to the "
        f"mechanisms (kernels/layouts.py): {sorted(found - FORMAT_STATE_LEFT)}"
    )
    assert found >= FORMAT_STATE_LEFT, "an exception that no longer applies"
    cache = "_seen = {}\ndef f(k):\n    _seen[k] = 1\n    _seen.clear()\n"
    assert sorted(process_state(ast.parse(cache))) == ["_seen", "_seen"]


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
    assert layer_of("hidden_state_reader.stages") == layer_of("hidden_state_reader.probes") == 2
    assert layer_of("hidden_state_connector.engine.worker_side") == LIBRARY
    graph = import_graph(all_modules())
    # Each mechanism is used from above: the rule has something to hold.
    assert "hidden_state_reader.files.locks" in graph["hidden_state_reader.read.claims"]
    assert "hidden_state_reader.kernels.crc" in graph["hidden_state_reader.files.publish"]
    assert "hidden_state_reader.stages" in graph["hidden_state_reader.store.read_ahead"]


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


# --- Mechanisms with one home (issue 43): files/ for inotify, flock and publishing by
# rename; kernels/host_memory.py for page-locked memory. Each list of exceptions names
# the module and why; an exception that no longer applies fails the test too.
FILES = READER / "files"
HOST_MEMORY = READER / "kernels" / "host_memory.py"
CONNECTOR = PACKAGES["hidden_state_connector"]
ENGINE = CONNECTOR / "engine"

FLOCK_ELSEWHERE = {
    # The connector's start-up probe of the storage (flock, rename, unlink on a scratch
    # file): the capture engine's, left to its owner (issue 43, the engine seam).
    ENGINE / "storage_check.py",
}
RENAME_ELSEWHERE = {
    ENGINE / "storage_check.py",  # as above: the probe renames a scratch file
}
PINNED_ELSEWHERE = {
    # The capture engine's own page-locked buffers, left to its owner (issue 43):
    ENGINE / "write" / "gather.py",  # each slab's non-finite flag
}
TENSOR_FACTORIES = frozenset(
    {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "empty_strided"}
    | {"empty_like", "zeros_like", "ones_like", "full_like", "rand", "randn", "arange"}
)


def package_sources() -> Iterator[tuple[Path, ast.AST]]:
    for directory in PACKAGES.values():
        for path in sorted(directory.rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _name(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def file_mechanisms(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each use of inotify, ``flock``/``lockf`` or ``fcntl``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            if name.split(".")[0] == "fcntl":
                yield node.lineno, "import fcntl"
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and text.startswith("inotify_"):
            yield node.lineno, repr(text)
        if isinstance(node, (ast.Attribute, ast.Name)) and (_name(node) or "").startswith(
            "inotify_"
        ):
            yield node.lineno, f"{_name(node)}"


def rename_publishes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each ``os.replace``/``os.rename``/``os.renames`` call, and each
    ``Path.replace``/``Path.rename`` call (a method of that name with one argument)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, owner = node.func, node.func.value
        if func.attr in ("replace", "rename", "renames") and _name(owner) == "os":
            yield node.lineno, f"os.{func.attr}"
        elif func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
            yield node.lineno, f".{func.attr}()"


def pinned_allocations(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each page-locked allocation: a torch tensor factory called
    with ``pin_memory`` (not a literal False), ``.pin_memory()``, ``cudaHostAlloc`` or
    ``cudaHostRegister``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name == "pin_memory":
                yield node.lineno, ".pin_memory()"
            for keyword in node.keywords:
                unpinned = isinstance(keyword.value, ast.Constant) and not keyword.value.value
                factory = (
                    name in TENSOR_FACTORIES and _name(getattr(node.func, "value", None)) == "torch"
                )
                if keyword.arg == "pin_memory" and factory and not unpinned:
                    yield node.lineno, f"{name}(pin_memory=...)"
        elif isinstance(node, (ast.Attribute, ast.Name)) and _name(node) in (
            "cudaHostAlloc",
            "cudaHostRegister",
        ):
            yield node.lineno, str(_name(node))


def outside(home: Path, allowed: set[Path], finder: object) -> tuple[list[str], set[Path]]:
    """Uses found outside ``home`` (a folder or a module) and not ``allowed``; and the
    allowed modules that have none any more."""
    found, used = [], set()
    for path, tree in package_sources():
        if path == home or home in path.parents:
            continue
        hits = list(finder(tree))  # type: ignore[operator]
        if path in allowed:
            if hits:
                used.add(path)
            continue
        found += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in hits]
    return found, allowed - used


def test_inotify_and_flock_only_in_files() -> None:
    found, stale = outside(FILES, FLOCK_ELSEWHERE, file_mechanisms)
    assert found == [], "inotify and flock are files/'s (held_files, locks, flockwait):\n" + (
        "\n".join(found)
    )
    assert stale == set(), f"exceptions that no longer apply: {sorted(map(str, stale))}"


def test_publishing_by_rename_only_in_files() -> None:
    found, stale = outside(FILES, RENAME_ELSEWHERE, rename_publishes)
    assert found == [], "publish by rename through files/atomic.py (write_atomic, move):\n" + (
        "\n".join(found)
    )
    assert stale == set(), f"exceptions that no longer apply: {sorted(map(str, stale))}"


def test_pinned_memory_only_from_the_host_memory_home() -> None:
    found, stale = outside(HOST_MEMORY, PINNED_ELSEWHERE, pinned_allocations)
    assert found == [], "page-locked memory comes from kernels/host_memory.py:\n" + (
        "\n".join(found)
    )
    assert stale == set(), f"exceptions that no longer apply: {sorted(map(str, stale))}"


def test_the_mechanism_finders_see_what_they_forbid() -> None:
    code = (
        "import fcntl\nfrom fcntl import flock\nlibc.inotify_init1(0)\n"
        "getattr(libc, 'inotify_add_watch')\nos.replace(a, b)\nos.rename(a, b)\n"
        "Path(a).rename(b)\ns.replace('a', 'b')\np.replace(b)\n"
        "torch.empty(3, pin_memory=True)\ntorch.zeros(3, pin_memory=pinned)\n"
        "torch.empty(3, pin_memory=False)\nt.pin_memory()\ncudart().cudaHostRegister(p)\n"
        "host_memory.empty((3,), dtype, pin_memory=True)\nDataLoader(d, pin_memory=True)\n"
    )
    tree = ast.parse(code)
    assert [line for line, _ in file_mechanisms(tree)] == [1, 2, 3, 4]
    assert sorted(line for line, _ in rename_publishes(tree)) == [5, 6, 7, 9]
    assert sorted(line for line, _ in pinned_allocations(tree)) == [10, 11, 13, 14]
