"""``hidden-state store-master`` / ``store-host`` stop with SIGTERM or SIGINT, leaving nothing.

Each launcher runs in the test store's loopback namespace (ports of their own) and is
stopped as docs/scale-out.md says: ``kill PID`` or Ctrl-C. Afterwards no process may
still run the Mooncake binary it started (before, the binary outlived its launcher and
kept the port).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_cluster import MASTER, StoreCluster, needs_store

pytestmark = needs_store

CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except FileNotFoundError:
        return []


def running(marker: str) -> list[int]:
    """Pids whose command line holds ``marker`` (a flag only our binary was given)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and marker in cmdline(int(p))]


def wait_for_binary(proc: subprocess.Popen[str], binary: str) -> None:
    """Until the launcher's pid runs ``binary`` (nsenter and Python exec into it)."""
    deadline = time.monotonic() + 60
    while not any(os.path.basename(arg) == binary for arg in cmdline(proc.pid)[:1]):
        assert proc.poll() is None, f"the launcher exited {proc.returncode}"
        assert time.monotonic() < deadline, f"{binary} did not start: {cmdline(proc.pid)}"
        time.sleep(0.05)  # polling another program's start: nothing to block on


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", ["store-master", "store-host"])
def test_a_stopped_launcher_leaves_no_binary_behind(
    cluster: StoreCluster, command: str, sig: signal.Signals, tmp_path: Path
) -> None:
    if command == "store-master":
        marker, binary = "--rpc_port=50071", "mooncake_master"
        args = ["store-master", "--host", "127.0.0.1", "--port", "50071"]
    else:
        marker, binary = "--port=50072", "mooncake_client"
        args = ["store-host", "--master", MASTER, "--size", "16MB", "--port", "50072"]
    with open(tmp_path / "launcher.log", "w") as log:
        proc = cluster.net.popen([*CLI, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_binary(proc, binary)
        assert running(marker) == [proc.pid], "the launcher is the binary: one process"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert running(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
