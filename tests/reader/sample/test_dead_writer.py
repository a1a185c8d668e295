"""A dead writer is stale at once where that can be known: on its own host.

The lock records who writes (pid, host, boot id, PID namespace, process start time);
``check_writer`` looks the pid up in ``/proc``. Every test here runs with a grace period
of an hour: a lock judged ``stale`` here was judged so because its writer is known to be
gone, not because the grace period ran out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.apps.cli import main as cli_main
from hidden_state_reader.files.identity import (
    WriterFate,
    check_writer,
    process_seen,
    writer_identity,
)
from hidden_state_reader.files.locks import WriterLock, read_status
from hidden_state_reader.format.lock_status import encode_status
from hidden_state_reader.sample.health import check_sample
from hidden_state_reader.sample.states import SampleState

from procs import WRITER, hold_lock
from samples import write_samples

HOUR = "3600"
CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def killed_writer(root: Path, name: str) -> int:
    """A real writer process that took the sample's lock, SIGKILLed (and reaped)."""
    proc = hold_lock(root / name)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return proc.pid


def fake_lock(root: Path, name: str, **detail: object) -> Path:
    """A free lock file whose status says ``writing`` by the writer ``detail`` names."""
    path = root / (name + ".lock")
    path.write_bytes(encode_status("writing", **detail))
    return path


def test_the_lock_records_who_writes(hs_dir: Path) -> None:
    lock = WriterLock.create(str(hs_dir / "a.safetensors"), request_id="r1")
    try:
        detail = read_status(lock.path).detail
    finally:
        lock.release()
    seen = process_seen(os.getpid())
    assert seen is not None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert detail == {
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "boot_id": boot,
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "start_ticks": seen.start_ticks,
        "request_id": "r1",
    }


def test_killed_writer_is_stale_at_once_in_every_tool(
    hs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_samples(hs_dir, 1)
    pid = killed_writer(hs_dir, "dead.safetensors")

    proc = run("verify", hs_dir, "--grace", HOUR)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "dead.safetensors" in line)
    assert row.split()[0] == "stale"
    assert f"its writer (pid {pid} on this host) is gone" in row

    capsys.readouterr()
    assert cli_main.main(["ls", str(hs_dir), "--grace", HOUR, "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["dead.safetensors"]["state"] == "stale"
    assert listed["dead.safetensors"]["writer_process"]["fate"] == "gone"

    rc = cli_main.main(["inspect", str(hs_dir / "dead.safetensors"), "--grace", HOUR])
    out = capsys.readouterr().out
    assert rc == 1
    assert "stale: lock released, the data file never appeared and its writer" in out

    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.5, orphan_grace=3600)
    assert [os.path.basename(s.path) for s in reader] == ["hs_0.safetensors"]
    assert reader.stats.stale_locks == 1

    # clean removes it now although it is young (and older-than is an hour).
    proc = run("clean", hs_dir, "--older-than", HOUR)
    assert proc.returncode == 0, proc.stderr
    assert not (hs_dir / "dead.safetensors.lock").exists()
    assert "stale lock (writer gone)" in proc.stdout
    assert run("verify", hs_dir, "--grace", HOUR).returncode == 0


def test_a_reused_pid_does_not_fool_it(hs_dir: Path) -> None:
    me = writer_identity()  # this process: alive, so only the start time can tell
    fake_lock(hs_dir, "reused.safetensors", **{**me, "start_ticks": me["start_ticks"] + 1})
    health = check_sample(hs_dir, "reused.safetensors", grace=3600)
    assert health.state is SampleState.STALE, health.reason
    assert "the pid now names another process" in health.reason
    assert health.writer_gone


def test_where_it_cannot_be_known_the_grace_period_stays(hs_dir: Path) -> None:
    me = writer_identity()
    cases = {
        "alive.safetensors": (me, WriterFate.RUNNING, "on this host) is running"),
        "elsewhere.safetensors": (
            {**me, "host": "gpu-node-7", "boot_id": "0" * 36},
            WriterFate.ELSEWHERE,
            "ran on host gpu-node-7: not checkable here",
        ),
        # Another boot id under this host's name: another node with the same host name
        # (containers), or this host before a restart; not told apart, so not gone.
        "same-name.safetensors": (
            {**me, "boot_id": "0" * 36},
            WriterFate.ELSEWHERE,
            f"ran on host {me['host']}: not checkable here",
        ),
        "container.safetensors": (
            {**me, "pid_ns": "pid:[1]"},
            WriterFate.ELSEWHERE,
            "another PID namespace",
        ),
        # A lock of an older writer: pid and host only.
        "old.safetensors": ({"pid": 999_999, "host": me["host"]}, WriterFate.UNKNOWN, "older"),
    }
    for name, (detail, fate, why) in cases.items():
        lock = fake_lock(hs_dir, name, **detail)
        assert check_writer(read_status(str(lock))).fate is fate
        young = check_sample(hs_dir, name, grace=3600)
        assert young.state is SampleState.PENDING, name
        assert why in young.reason and "the 3600s grace period applies" in young.reason
        assert not young.writer_gone
        old = check_sample(hs_dir, name, grace=0)
        assert old.state is SampleState.STALE and why in old.reason
    (hs_dir / "vllm.safetensors.lock").write_bytes(b"")  # vLLM's empty lock
    assert check_sample(hs_dir, "vllm.safetensors", grace=3600).state is SampleState.PENDING


def test_verify_says_which_locks_only_the_grace_period_can_judge(hs_dir: Path) -> None:
    write_samples(hs_dir, 1)
    me = writer_identity()
    fake_lock(hs_dir, "far.safetensors", **{**me, "host": "gpu-node-7", "boot_id": "0" * 36})
    proc = run("verify", hs_dir, "--grace", HOUR)
    assert proc.returncode == 0, proc.stdout
    assert (
        "pending far.safetensors: lock free for now and no data yet; lock created "
    ) in proc.stdout
    assert "ran on host gpu-node-7: not checkable here, so the 3600s grace period applies" in (
        proc.stdout
    )
    report = json.loads(run("verify", hs_dir, "--grace", HOUR, "--json").stdout)
    [undecided] = report["undecided"]
    assert undecided["name"] == "far.safetensors"
    assert undecided["writer_process"]["fate"] == "elsewhere"


def partial_writer(path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real writer process half-way through ``path``: its lock held, its temp file growing."""
    proc = subprocess.Popen([*WRITER, "partial", str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    temp = Path(proc.stdout.readline().strip())
    if not temp.is_file():
        proc.kill()
        raise AssertionError(f"the writer did not start (exit {proc.wait()})")
    return proc, temp


def test_a_killed_writers_temp_file_is_abandoned_and_cleaned_at_once(
    hs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live, live_temp = partial_writer(hs_dir / "live.safetensors")
    dead, dead_temp = partial_writer(hs_dir / "dead.safetensors")
    try:
        dead.kill()
        assert dead.wait(timeout=30) == -signal.SIGKILL
        # A temp file next to a free lock whose writer still runs: only the grace decides.
        (hs_dir / "idle.safetensors.tmp.1.0123456789ab").write_bytes(b"x")
        fake_lock(hs_dir, "idle.safetensors", **writer_identity())

        assert cli_main.main(["ls", str(hs_dir), "--all", "--grace", HOUR, "--json"]) == 0
        temps = {r["name"]: r for r in json.loads(capsys.readouterr().out) if r["kind"] == "temp"}
        assert temps[dead_temp.name]["state"] == "orphan_temp"
        assert temps[dead_temp.name]["writer_process"]["fate"] == "gone"
        why = temps[dead_temp.name]["reason"]
        assert f"abandoned: its lock is free and its writer (pid {dead.pid} on this " in why
        assert temps[live_temp.name]["state"] == "pending"
        assert temps["idle.safetensors.tmp.1.0123456789ab"]["state"] == "pending"
        assert cli_main.main(["ls", str(hs_dir), "--all", "--grace", HOUR]) == 0
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
        assert rows[dead_temp.name].endswith("orphan_temp (writer gone)")
        assert rows[live_temp.name].endswith("pending")

        proc = run("clean", hs_dir, "--older-than", HOUR)
        assert proc.returncode == 0, proc.stderr
        assert not dead_temp.exists() and not (hs_dir / "dead.safetensors.lock").exists()
        assert "orphan temp file (writer gone)" in proc.stdout
        assert live_temp.exists() and (hs_dir / "live.safetensors.lock").exists()
        assert (hs_dir / "idle.safetensors.tmp.1.0123456789ab").exists()
        assert live.poll() is None  # still writing, untouched
    finally:
        live.kill()
        live.wait(timeout=30)
