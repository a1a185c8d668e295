"""Helpers for tests that run several processes at once."""

from __future__ import annotations

import importlib.util
import multiprocessing
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

WRITER = [sys.executable, str(Path(__file__).resolve().parent / "tools" / "writer.py")]
"""Command of the separate writer process (``tests/tools/writer.py MODE ARGS``)."""

TEST_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""What tests/conftest.py sets for the engines tests start (see the reason there)."""

VLLM_MISSING = importlib.util.find_spec("vllm") is None
"""Whether vLLM is absent (tests marked ``vllm`` are skipped, tests/connector is not
collected). A check without an import: importing vLLM costs seconds in every test process
that collects the test files.
"""

IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

DEMO = [sys.executable, "-m", "hidden_state_connector.apps.cli.demo"]
"""The ``hidden-state demo`` command, as the demo tests run it."""
"""Environment of an offline ``LLM`` whose engine runs in the calling process.

vLLM's in-process mode, which users also run. On the CPU build a multiprocess ``LLM``
is three interpreters that each import vLLM (the script, the engine core and, because
the CPU platform always picks the ``mp`` executor there, a worker): about 28 s more CPU
per engine start on this project's 2-core machine. Tests whose subject is not the process
layout use this; tests/connector/test_delivery.py runs every layout.

For ``vllm serve`` the engine core still runs in a process of its own; the setting keeps
the model in it (vLLM's ``uni`` executor, as on one GPU, where that is vLLM's default)
instead of in a third process: measured here, ready after 25 s and 25 CPU-s instead of
37 s and 38.5 CPU-s. The servers of tests/connector/test_server.py and
tests/reliability/test_server_kill.py keep the CPU build's default (a worker process).
"""


def start_together(
    procs: list[tuple[subprocess.Popen[str], str]],
    before_go: Callable[[], object] | None = None,
) -> None:
    """Wait until each process has printed its line, then send every one "go".

    Starting a Python process that imports torch takes seconds on a loaded machine;
    tests whose processes must run at the same time (or whose readers have idle
    timeouts) start them with a line on stdin instead of relying on start-up times.

    Args:
        procs: Each process (started with stdin and stdout pipes, text mode) and the line
            it prints once it is loaded.
        before_go: Called once all are loaded, just before "go" is sent.
    """
    try:
        for proc, line in procs:
            assert proc.stdout is not None
            said = proc.stdout.readline().strip()
            if said != line:
                proc.kill()
                _, err = proc.communicate()
                raise AssertionError(f"expected {line!r}, got {said!r}; stderr:\n{err}")
        if before_go is not None:
            before_go()
        for proc, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
    except BaseException:
        for proc, _ in procs:
            proc.kill()
        raise


def hold_lock(path: Path) -> subprocess.Popen[str]:
    """A writer process holding ``path``'s lock until it is told to write (or killed)."""
    proc = subprocess.Popen(
        [*WRITER, "hold", str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if proc.stdout is None or proc.stdout.readline().strip() != "locked":
        proc.kill()
        raise AssertionError(f"the lock holder did not start (exit {proc.wait()})")
    return proc


def run_ranks(target: Callable[..., None], args: Callable[[int], tuple[object, ...]]) -> list:
    """Run ``target(*args(rank), queue)`` in two forked processes; what they put, sorted.

    Each process puts one result on the queue; both must exit 0.
    """
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args(rank), queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A separate process that takes and drops locks on request: what another reader or a
# writer elsewhere does to the files under test.
HOLDER = r"""
import fcntl, os, sys
from hidden_state_reader.files.locks import WriterLock
held = {}
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, path = line.rstrip("\n").partition(" ")
    if cmd == "lock":
        held[path] = WriterLock.create(path)
    elif cmd == "flock":
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held[path] = fd
    elif cmd == "release":
        h = held.pop(path)
        h.release() if hasattr(h, "release") else os.close(h)
    print(cmd + " " + path, flush=True)
"""


class LockHolder:
    """Drives the HOLDER process; each call returns once the process has answered."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"lock holder died (rc={self.proc.poll()})"
        return line.strip()

    def _ask(self, cmd: str, path: Path) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd} {path}\n")
        self.proc.stdin.flush()
        assert self._line() == f"{cmd} {path}"

    def lock(self, data_path: Path) -> None:
        self._ask("lock", data_path)

    def flock(self, path: Path) -> None:
        self._ask("flock", path)

    def release(self, path: Path) -> None:
        self._ask("release", path)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
