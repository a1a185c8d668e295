"""Importing the package changes nothing: no torch.utils.data, no signal handler.

Each check runs in a fresh interpreter, since this test process has imported everything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = """
import signal, sys
wake = int(sys.argv[1])
before = signal.getsignal(wake)
import {module}
assert signal.getsignal(wake) == before, "importing {module} installed a signal handler"
if {torch_free}:
    assert "torch.utils.data" not in sys.modules, "{module} imported torch.utils.data"
print("ok")
"""


def run_check(module: str, *, torch_free: bool) -> None:
    from hidden_state_reader.files.flockwait import WAKE_SIGNAL

    code = CHECK.format(module=module, torch_free=torch_free)
    result = subprocess.run(
        [sys.executable, "-c", code, str(WAKE_SIGNAL)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "module",
    [
        "hidden_state_reader",
        "hidden_state_reader.format",
        "hidden_state_reader.files",
        "hidden_state_reader.files.locks",
        "hidden_state_reader.kernels",
        "hidden_state_reader.files.flockwait",
        "hidden_state_reader.errors",
        "hidden_state_reader.apps.cli.common",
        "hidden_state_reader.apps.cli.toolkit",
    ],
)
def test_import_is_torch_free_and_installs_nothing(module: str) -> None:
    run_check(module, torch_free=True)


@pytest.mark.parametrize(
    "module",
    [
        "hidden_state_reader.files.flockwait",
        "hidden_state_reader.reader",
        "hidden_state_reader.training.dataset",
        "hidden_state_reader.training.loader",
        "hidden_state_reader.apps.cli.main",
    ],
)
def test_import_installs_no_signal_handler(module: str) -> None:
    run_check(module, torch_free=False)


def test_lazy_names_resolve() -> None:
    import hidden_state_reader

    for name in hidden_state_reader.__all__:
        assert getattr(hidden_state_reader, name) is not None
    with pytest.raises(AttributeError):
        _ = hidden_state_reader.no_such_name  # type: ignore[attr-defined]


# The public API; a change to it is deliberate, so it is written out here once more.
PUBLIC = [
    "CorruptSampleError",
    "FailedSampleError",
    "HiddenStateDataset",
    "HiddenStateError",
    "HiddenStateLoader",
    "HiddenStateReader",
    "IncompleteSampleError",
    "LoadOptions",
    "LockTimeoutError",
    "PackCollate",
    "PadCollate",
    "PathOutsideRootError",
    "ReaderStats",
    "Sample",
    "SampleError",
    "StaleLockError",
    "WaitCancelledError",
    "__version__",
    "dequantize",
    "distributed_context",
    "load_sample",
    "pack_collate",
    "pad_collate",
    "read_header",
    "write_sample",
]


def test_public_names_are_listed_once_and_type_checkers_see_the_same() -> None:
    import ast
    import importlib

    import hidden_state_reader

    assert hidden_state_reader.__all__ == PUBLIC
    exports = hidden_state_reader._EXPORTS
    for module, names in exports.items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is getattr(
                hidden_state_reader, name
            )
    # The imports under ``if TYPE_CHECKING:`` are exactly _EXPORTS, each an explicit
    # re-export (``X as X``) so strict type checkers let users import it.
    tree = ast.parse(Path(hidden_state_reader.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    seen: dict[str, list[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported"
            seen.setdefault(node.module, []).append(alias.name)
    assert seen == {module: list(names) for module, names in exports.items()}


LAZY = """
import fcntl, os, signal, sys, tempfile, threading
from hidden_state_reader.files.flockwait import WAKE_SIGNAL, _on_wake, flock_wait
path = tempfile.mktemp()
holder = os.open(path, os.O_RDWR | os.O_CREAT)
fcntl.flock(holder, fcntl.LOCK_EX)
waiter = os.open(path, os.O_RDONLY)
# A first blocking wait on another thread cannot install the handler: it falls back.
out = []
t = threading.Thread(target=lambda: out.append(flock_wait(waiter, timeout=0.05)))
t.start(); t.join()
assert out == [False] and signal.getsignal(WAKE_SIGNAL) is not _on_wake
# The first one on the main thread installs it, and times out by the signal.
assert flock_wait(waiter, timeout=0.05) is False
assert signal.getsignal(WAKE_SIGNAL) is _on_wake
print("ok")
"""


def test_wake_handler_is_installed_at_the_first_main_thread_wait() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_building_a_reader_installs_the_wake_handler(tmp_path: object) -> None:
    code = (
        "import signal, sys\n"
        "from hidden_state_reader import HiddenStateReader\n"
        "from hidden_state_reader.files.flockwait import WAKE_SIGNAL, _on_wake\n"
        "HiddenStateReader(sys.argv[1])\n"
        "assert signal.getsignal(WAKE_SIGNAL) is _on_wake\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
