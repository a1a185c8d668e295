"""Group membership through flock-held member files (``read.membership``), across processes."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hidden_state_reader.files import held_files as held_files_module
from hidden_state_reader.format.names import temp_path
from hidden_state_reader.read.membership import Membership

# A member in another process: joins, says so, then waits (until killed or told to leave).
MEMBER = """
import sys
from hidden_state_reader.read.membership import Membership
m = Membership(sys.argv[1], "g", sys.argv[2])
m.join()
print("joined", flush=True)
if sys.stdin.readline().strip() == "leave":
    m.leave()
    print("left", flush=True)
sys.stdin.readline()
"""


def start_member(claims: Path, name: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(claims), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"
    return proc


def test_members_see_each_other_and_a_live_member_cannot_be_reaped(tmp_path: Path) -> None:
    other = start_member(tmp_path, "other")
    try:
        me = Membership(str(tmp_path), "g", "me", refresh=0.0)
        me.join()
        assert me.members() == ("me", "other")
        assert me.neighbour() == "other"
        assert me.alive("other") and me.alive("me")
        assert not me.reap("other")
        assert me.members() == ("me", "other")
    finally:
        other.kill()
        other.wait()


def test_a_killed_member_is_dead_and_reaped_once(tmp_path: Path) -> None:
    other = start_member(tmp_path, "other")
    me = Membership(str(tmp_path), "g", "me", refresh=0.0)
    me.join()
    other.send_signal(signal.SIGKILL)  # the kernel releases its member file's lock
    other.wait()
    assert me.members() == ("me", "other")  # its file is still there...
    assert not me.alive("other")  # ...but nobody holds it
    assert me.watch_neighbour() is True
    assert me.members() == ("me",) and me.reaped == 1
    assert me.reap("other") is False  # gone already


def test_a_member_that_leaves_is_gone_from_every_listing(tmp_path: Path) -> None:
    other = start_member(tmp_path, "other")
    me = Membership(str(tmp_path), "g", "me", refresh=0.0)
    me.join()
    assert me.members() == ("me", "other")
    assert other.stdin is not None and other.stdout is not None
    other.stdin.write("leave\n")
    other.stdin.flush()
    assert other.stdout.readline().strip() == "left"
    assert me.members() == ("me",)
    other.stdin.write("\n")
    other.stdin.flush()
    assert other.wait(timeout=30) == 0
    me.leave()
    assert os.listdir(me.directory) == []


def test_groups_do_not_see_each_other(tmp_path: Path) -> None:
    a = Membership(str(tmp_path), "job-a", "r1", refresh=0.0)
    b = Membership(str(tmp_path), "job-b", "r2", refresh=0.0)
    a.join()
    b.join()
    assert a.members() == ("r1",) and b.members() == ("r2",)


def test_a_joiners_temporary_file_is_no_member_and_never_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member watching the group while another joins leaves the joiner's file alone.

    ``join`` creates its file under a temporary name and locks it before linking it into
    place; between the two, the temporary file exists unlocked. A member that took it for
    a member would find it dead, reap it, and the joiner's ``link`` would then fail with
    ``FileNotFoundError`` (seen once: a claim worker of ``test_many_readers`` crashed).
    """
    watcher = Membership(str(tmp_path), "g", "a", refresh=0.0)
    watcher.join()
    joiner = Membership(str(tmp_path), "g", "b", refresh=0.0)
    real_flock = held_files_module.fcntl.flock
    seen: list[tuple[str, ...]] = []

    def flock_after_a_look(fd: int, op: int) -> None:
        # The fault, at the exact moment: the watcher runs between the joiner's creation
        # of its temporary file and its lock (once: its own probes lock too).
        if not seen:
            seen.append(watcher.members())
            watcher.watch_neighbour()
        real_flock(fd, op)

    monkeypatch.setattr(held_files_module, "fcntl", SimpleNamespace(
        flock=flock_after_a_look, LOCK_EX=fcntl.LOCK_EX, LOCK_SH=fcntl.LOCK_SH,
        LOCK_NB=fcntl.LOCK_NB))  # fmt: skip
    joiner.join()
    assert seen == [("a",)]  # the temporary file was there, but is no member
    assert watcher.reaped == 0
    assert watcher.members() == ("a", "b") and watcher.alive("b")


def test_a_temporary_file_left_by_a_killed_joiner_is_no_member(tmp_path: Path) -> None:
    me = Membership(str(tmp_path), "g", "me", refresh=0.0)
    me.join()
    stale = Path(temp_path(os.path.join(me.directory, "other")))
    stale.write_bytes(b"")  # a joiner killed before it linked its file into place
    assert me.members() == ("me",)
    assert me.neighbour() is None
    # Only names temp_path makes are left out: a host may have ".tmp." in its name.
    odd_host = Membership(str(tmp_path), "g", "node.tmp.lab:123:0123abcd", refresh=0.0)
    odd_host.join()
    assert me.members() == ("me", "node.tmp.lab:123:0123abcd")
