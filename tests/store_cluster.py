"""A real Mooncake Store for tests: master and segment host in a loopback-only namespace.

Used by tests/mooncake (through its conftest) and by the store example's test.

Every process of a store test (master, segment host, producers, readers, vLLM) runs in
one network namespace that holds only ``lo``: Mooncake's listeners bind 0.0.0.0
whatever they are told, and fixed ports cannot collide with anything outside. The
namespace is held by a sleeping process, so it disappears with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MASTER_PORT = 50051
MASTER = f"127.0.0.1:{MASTER_PORT}"


def url(prefix: str) -> str:
    """The reader URL of ``prefix`` in the test store."""
    return f"mooncake://{MASTER}/{prefix}?hostname=127.0.0.1"


def _unavailable() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine(-non-cuda) is not installed (make test installs it)"
    if not _binary("mooncake_master"):
        return "mooncake_master is not installed"
    if not shutil.which("unshare") or not shutil.which("nsenter") or os.geteuid() != 0:
        return "needs root with unshare/nsenter for a loopback-only network namespace"
    return None


def _binary(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else (shutil.which(name) or "")


STORE_UNAVAILABLE = _unavailable()
needs_store = pytest.mark.skipif(STORE_UNAVAILABLE is not None, reason=STORE_UNAVAILABLE or "")


def write_store_samples(
    root: Path, names: list[str], *, tokens: int = 8, layers: int = 3, hidden: int = 16
) -> list[Path]:
    """Sample files as the store backend writes them (CRC32 recorded), distinct values."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, name in enumerate(names):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        hidden_states = torch.randn(tokens, layers, hidden, generator=gen).bfloat16()
        meta = sample_metadata(layer_ids=list(range(layers)), request_id=f"req-{i}")
        path = root / f"{name}.safetensors"
        write_sample(path, torch.arange(tokens) + i, hidden_states, metadata=meta,
                     use_lock=False, checksum=True)  # fmt: skip
        paths.append(path)
    return paths


class LoopbackNet:
    """A network namespace with only loopback up, and helpers to run processes in it."""

    def __init__(self) -> None:
        # The holder says "up" once loopback is up inside its new namespace.
        self.holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo up && exec sleep 3600"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "up":
            self.holder.kill()
            code = self.holder.wait()
            raise RuntimeError(f"the loopback namespace did not come up (exit {code})")

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *argv]

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        return subprocess.Popen(self.argv(argv), text=True, env=env, cwd=TESTS, **kwargs)  # type: ignore[call-overload]

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class StoreCluster:
    """``mooncake_master`` plus one segment host (``mooncake_client``) in a namespace.

    The segment host is a process of its own, as it would run next to the trainers:
    producers and readers contribute no memory, so killing them loses nothing stored.
    """

    def __init__(self, logs: Path, segment: str = "256MB") -> None:
        self.net = LoopbackNet()
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.master = self._daemon("master", [
            _binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={MASTER_PORT}",
            "--rpc_thread_num=4",
            # Not the default admin/metrics port (9003): a master that tests/mooncake/
            # test_launchers.py starts in this namespace with the defaults needs it.
            "--metrics_port=9013",
        ])  # fmt: skip
        self.host = self._daemon("segment_host", [
            _binary("mooncake_client"), f"--global_segment_size={segment}",
            f"--master_server_address={MASTER}", "--metadata_server=P2PHANDSHAKE",
            "--host=127.0.0.1", "--port=50060",
        ])  # fmt: skip
        # Ready once a put succeeds: the master answers and the segment is mounted.
        self.role("probe", "--full-timeout", "20", timeout=60)

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen[str]:
        with open(self.logs / f"{name}.log", "w") as log:
            return self.net.popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def role(self, *args: str, timeout: float = 120) -> dict:
        """Run ``tools.store_role`` to completion; its JSON result."""
        return finish(self.start(*args), timeout)

    def start(self, *args: str) -> subprocess.Popen[str]:
        """Start ``tools.store_role`` (stdout piped, stderr to a log file)."""
        with open(self.logs / f"{args[0]}-{time.monotonic_ns()}.log", "w") as log:
            return self.net.popen([sys.executable, "-m", "tools.store_role", *args],
                                  stdout=subprocess.PIPE, stderr=log)  # fmt: skip

    def close(self) -> None:
        for proc in (self.host, self.master):
            proc.kill()
            proc.wait()
        self.net.close()


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> dict:
    """Wait for a role process; its (last) JSON result line."""
    return finish_all(proc, timeout)[-1]


def finish_all(proc: subprocess.Popen[str], timeout: float = 120) -> list[dict]:
    """Wait for a role process; all its JSON result lines."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}"
    # Only the role's JSON lines (vLLM prints progress on stdout too).
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreCluster]:
    """A store (master + 256 MB segment host) shared by the tests of one module."""
    if STORE_UNAVAILABLE:
        pytest.skip(STORE_UNAVAILABLE)
    store = StoreCluster(tmp_path_factory.mktemp("store-logs"))
    yield store
    store.close()
