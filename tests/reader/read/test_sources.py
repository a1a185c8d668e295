"""Following a directory while a separate process keeps writing into it."""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import WriterLock

from procs import WRITER, hold_lock
from samples import write_samples


@pytest.mark.parametrize("watch", ["auto", "poll"])
def test_follow_picks_up_files_written_after_start(hs_dir: Path, watch: str) -> None:
    write_samples(hs_dir, 5, prefix="old_")
    reader = HiddenStateReader(
        hs_dir, follow=True, idle_timeout=30, max_samples=205, watch=watch, poll_interval=0.2
    )
    it = iter(reader)
    first = [next(it) for _ in range(5)]  # what was there before
    assert [os.path.basename(s.path) for s in first] == [f"old_{i}.safetensors" for i in range(5)]
    writer = subprocess.Popen(
        [*WRITER, "stream", str(hs_dir), "200"], stdout=subprocess.PIPE, text=True
    )
    rest = list(it)  # ends at max_samples
    assert writer.wait(timeout=60) == 0
    assert len(rest) == 200
    assert len({s.path for s in first + rest}) == 205


def test_follow_ends_after_idle_timeout(hs_dir: Path) -> None:
    write_samples(hs_dir, 2)
    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.5)
    assert len(list(reader)) == 2


def test_follow_waits_for_a_lock_seen_before_its_data(hs_dir: Path) -> None:
    # The lock appears first (pre-created by the server at schedule time): a sample is coming.
    proc = subprocess.Popen(
        [*WRITER, "hold", str(hs_dir / "late.safetensors")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "locked"
    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=60, lock_timeout=30)
    it = iter(reader)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    sample = next(it)  # woken by the lock's release
    assert os.path.basename(sample.path) == "late.safetensors"
    assert proc.wait(timeout=10) == 0
    reader.close()


def test_close_stops_a_follow_reader_waiting_for_news(hs_dir: Path) -> None:
    reader = HiddenStateReader(hs_dir, follow=True)
    finished = threading.Event()
    t = threading.Thread(target=lambda: (list(reader), finished.set()))
    t.start()
    assert not finished.wait(0.2)
    reader.close()
    assert finished.wait(5)


def test_follow_with_delete_leaves_an_empty_directory(hs_dir: Path) -> None:
    reader = HiddenStateReader(
        hs_dir, follow=True, idle_timeout=60, on_consumed="delete", max_samples=50
    )
    writer = subprocess.Popen(
        [*WRITER, "stream", str(hs_dir), "50"], stdout=subprocess.PIPE, text=True
    )
    assert len(list(reader)) == 50
    writer.wait(timeout=60)
    assert [f for f in os.listdir(hs_dir) if not f.startswith(".")] == []
    assert reader.stats.vanished == 0, "late events about deleted files are not news"


def test_stale_lock_of_a_dead_writer_is_reported_not_waited_on(hs_dir: Path) -> None:
    lock = WriterLock.create(str(hs_dir / "dead.safetensors"))
    lock.release()  # writer gone, no data, no failure status
    old = os.stat(hs_dir / "dead.safetensors.lock").st_mtime - 60
    os.utime(hs_dir / "dead.safetensors.lock", (old, old))
    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.5)
    assert list(reader) == []
    assert reader.stats.stale_locks == 1


def test_an_inotify_queue_overflow_triggers_an_immediate_rescan(hs_dir: Path) -> None:
    from hidden_state_reader.files.inotify import RESCAN, Inotify
    from hidden_state_reader.read.sources import FollowSource

    source = FollowSource(str(hs_dir), rescan_interval=3600)
    try:
        assert source.watching
        assert source.next(timeout=0.05) is None  # initial scan only
        assert source.rescans == 1
        # Fault injection: the kernel dropped events (it says so with IN_Q_OVERFLOW).
        wd = next(w for w, sinks in Inotify._sinks.items() if source._sink in sinks)
        Inotify._dispatch(struct.pack("iIII", wd, 0x4000, 0, 0))
        assert RESCAN == ""
        assert source.next(timeout=0.5) is None
        assert (source.rescans, source.overflows) == (2, 1)
    finally:
        source.close()


def _blocked_signals(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as status:
        for line in status:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def test_watcher_threads_leave_ctrl_c_to_the_main_thread(hs_dir: Path) -> None:
    """A Ctrl-C delivered to the watcher thread would leave the main thread asleep."""
    import signal

    from hidden_state_reader.read.sources import FollowSource

    source = FollowSource(str(hs_dir), watch="inotify")
    try:
        watchers = [t for t in threading.enumerate() if t.name == "hidden-state-inotify"]
        assert len(watchers) == 1  # one per process, whatever the number of directories
        for thread in watchers:
            assert thread.native_id is not None
            mask = _blocked_signals(thread.native_id)
            for sig in (signal.SIGINT, signal.SIGTERM):
                assert mask & (1 << (sig - 1)), f"{thread.name} takes signal {sig}"
        main = threading.main_thread().native_id
        assert main is not None and not _blocked_signals(main) & (1 << (signal.SIGINT - 1))
    finally:
        source.close()


def test_a_writer_that_dies_after_the_idle_timeout_held_up_nothing(hs_dir: Path) -> None:
    """A complete sample behind a busy writer is yielded at once; the reader ends on its
    idle timeout although that writer is still at work (a pending sample is no news)."""
    proc = hold_lock(hs_dir / "a.safetensors")
    try:
        write_samples(hs_dir, 1, prefix="b_")  # sorted after a, not queued behind it
        reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.5, lock_timeout=60)
        got = [os.path.basename(s.path) for s in reader]
        assert got == ["b_0.safetensors"]
        assert reader.pending == ["a.safetensors"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("lock_timeout", [0.3, 0.7], ids=["short", "over-half-idle"])
def test_a_writer_stuck_past_lock_timeout_does_not_keep_the_reader_alive(
    hs_dir: Path, lock_timeout: float
) -> None:
    # Each lock wait times out within the idle timeout (1 s) and the name is looked at
    # again later: neither the timeouts nor the name's return are news, so the reader ends.
    proc = hold_lock(hs_dir / "stuck.safetensors")
    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=1.0, lock_timeout=lock_timeout)
    try:
        t = threading.Thread(target=lambda: list(reader))
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "a stuck writer must not keep a follow reader running"
        assert reader.stats.lock_timeouts >= 1
    finally:
        proc.kill()
        proc.wait()
        reader.close()


def test_without_inotify_follow_polls_and_inotify_mode_says_why(
    hs_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a system without inotify (macOS, BSD) the reader polls with its own poller."""
    import ctypes

    from hidden_state_reader.files import inotify
    from hidden_state_reader.read import sources

    class NoInotifyLibc:  # fault injection: this Linux libc has the symbol
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    monkeypatch.setattr(inotify.ctypes, "CDLL", NoInotifyLibc)
    monkeypatch.setattr(inotify.Inotify, "_fd", None)  # as in a process not watching yet
    assert ctypes.CDLL is NoInotifyLibc
    with pytest.raises(OSError, match="inotify is not available"):
        sources.FollowSource(str(hs_dir), watch="inotify")
    write_samples(hs_dir, 2)
    with caplog.at_level("WARNING"):
        source = sources.FollowSource(str(hs_dir), watch="auto", poll_interval=0.1)
    try:
        assert not source.watching
        assert "polling every 0.1s" in caplog.text
        assert {source.next(timeout=1), source.next(timeout=1)} == {
            "hs_0.safetensors",
            "hs_1.safetensors",
        }
    finally:
        source.close()
