"""A real Mooncake Store for tests: master and segment host in a loopback-only namespace.

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
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MASTER_PORT = 50051
MASTER = f"127.0.0.1:{MASTER_PORT}"
URL = f"mooncake://{MASTER}/hs?hostname=127.0.0.1"


def _unavailable() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine(-non-cuda) is not installed (make test installs it)"
    if not (BIN / "mooncake_master").exists() and not shutil.which("mooncake_master"):
        return "mooncake_master is not installed"
    if not shutil.which("unshare") or not shutil.which("nsenter") or os.geteuid() != 0:
        return "needs root with unshare/nsenter for a loopback-only network namespace"
    return None


_REASON = _unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _binary(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else str(shutil.which(name))


class LoopbackNet:
    """A network namespace with only loopback up, and helpers to run processes in it."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 3600"]
        )
        deadline = time.monotonic() + 10
        own = os.readlink("/proc/self/ns/net")
        while time.monotonic() < deadline:
            if os.readlink(f"/proc/{self.holder.pid}/ns/net") != own and self._lo_up():
                return
            time.sleep(0.01)
        raise RuntimeError("the loopback namespace did not come up")

    def _lo_up(self) -> bool:
        out = subprocess.run(self.argv(["ip", "-o", "link", "show", "lo"]),
                             capture_output=True, text=True)  # fmt: skip
        return ",UP" in out.stdout

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *argv]

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        return subprocess.Popen(self.argv(argv), text=True, env=env, cwd=TESTS, **kwargs)  # type: ignore[call-overload]

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class StoreCluster:
    """``mooncake_master`` plus one segment host (``mooncake_client``) in a namespace.

    The segment host is a process of its own, as it would run next to the trainers:
    producers and readers contribute no memory, so killing them loses nothing stored.
    """

    def __init__(self, net: LoopbackNet, logs: Path, segment: str = "256MB") -> None:
        self.net = net
        self.logs = logs
        self.master = net.popen(
            [_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={MASTER_PORT}",
             "--metrics_port=9003", "--rpc_thread_num=4"],
            stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.host = net.popen(
            [_binary("mooncake_client"), f"--global_segment_size={segment}",
             f"--master_server_address={MASTER}", "--metadata_server=P2PHANDSHAKE",
             "--host=127.0.0.1", "--port=50060"],
            stdout=open(logs / "segment_host.log", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        # Ready once a put succeeds: the master answers and the segment is mounted.
        self.role("probe", "--full-timeout", "20", timeout=40)

    def role(self, *args: str, timeout: float = 60) -> dict:
        """Run ``tools.store_role`` to completion; its JSON result."""
        proc = self.start(*args)
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"store_role {args} exited {proc.returncode}: see {self.logs}"
        return json.loads(out.strip().splitlines()[-1])

    def start(self, *args: str) -> subprocess.Popen[str]:
        """Start ``tools.store_role`` (stdout piped, stderr to a log file)."""
        log = open(self.logs / f"role-{time.monotonic_ns()}.log", "w")
        return self.net.popen([sys.executable, "-m", "tools.store_role", *args],
                              stdout=subprocess.PIPE, stderr=log)  # fmt: skip

    def close(self) -> None:
        for proc in (self.host, self.master):
            proc.kill()
            proc.wait()


@pytest.fixture()
def net() -> Iterator[LoopbackNet]:
    namespace = LoopbackNet()
    yield namespace
    namespace.close()


@pytest.fixture()
def cluster(net: LoopbackNet, tmp_path: Path) -> Iterator[StoreCluster]:
    store = StoreCluster(net, tmp_path)
    yield store
    store.close()
