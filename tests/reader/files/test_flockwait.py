"""Waiting for writers: the reader sleeps in flock(LOCK_SH) until a separate process is done."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader, WaitCancelledError
from hidden_state_reader.files.flockwait import install_wake_handler
from hidden_state_reader.files.locks import SharedLock, WriterLock

from procs import WRITER

SYS_FLOCK_X86_64 = 73


def start_writer(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*WRITER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc


def syscall_of(thread_id: int) -> str:
    return Path(f"/proc/self/task/{thread_id}/syscall").read_text().split()[0]


def test_reader_sleeps_in_flock_until_another_process_releases(hs_dir: Path) -> None:
    # The reader below is built on a helper thread; only the main thread can install the
    # wake handler that lets helper threads sleep in flock (the reader's docs: build it on
    # the main thread). Installed here, as a reader built on the main thread would, so the
    # test does not depend on which tests ran before it in this process.
    install_wake_handler()
    path = str(hs_dir / "hs_0.safetensors")
    writer = start_writer("hold", path)
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline().strip() == "locked"

    result: dict[str, object] = {}
    entered = threading.Event()

    def read() -> None:
        result["tid"] = threading.get_native_id()
        entered.set()
        samples = list(HiddenStateReader(hs_dir, on_error="raise"))
        result["woke"] = time.time()
        result["samples"] = samples

    reader = threading.Thread(target=read)
    reader.start()
    entered.wait()
    tid = int(result["tid"])  # type: ignore[arg-type]
    # The reader thread must be asleep inside flock(2), not spinning: wait until the kernel
    # reports it there (it gets there within microseconds of starting).
    deadline = time.monotonic() + 10
    while syscall_of(tid) != str(SYS_FLOCK_X86_64) and time.monotonic() < deadline:
        entered.wait(0.001)
    if os.uname().machine == "x86_64":
        assert syscall_of(tid) == str(SYS_FLOCK_X86_64)
    writer.stdin.write("go\n")
    writer.stdin.flush()
    released = float(writer.stdout.readline().split()[1])
    reader.join(timeout=60)
    assert not reader.is_alive(), "the release must wake the reader"
    assert writer.wait(timeout=60) == 0
    samples = result["samples"]
    assert len(samples) == 1  # type: ignore[arg-type]
    assert samples[0].num_tokens == 6  # type: ignore[index]
    # Woken by the kernel on release (it slept in flock, checked above); speed is the
    # latency benchmark's business, printed here for information only.
    latency = float(result["woke"]) - released  # type: ignore[arg-type]
    print(f"wake latency after release: {latency * 1000:.2f} ms")


def test_lock_timeout_leaves_no_thread_or_fd_behind(hs_dir: Path) -> None:
    path = str(hs_dir / "hs_0.safetensors")
    lock = WriterLock.create(path)  # held for the whole test (another open file description)

    # Only what is this test's own: other threads and fds of the process (earlier tests'
    # objects being collected) may come and go meanwhile.
    def deadline_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "hidden-state-lock-deadline"]

    def fds_into_dir() -> list[str]:
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the fd of listdir itself is gone
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sorted(t for t in targets if t.startswith(str(hs_dir)))

    threads_before = deadline_threads()
    fds_before = fds_into_dir()
    reader = HiddenStateReader(hs_dir, lock_timeout=0.2)
    assert list(reader) == []
    assert reader.stats.lock_timeouts == 1
    assert set(deadline_threads()) <= set(threads_before)
    assert fds_into_dir() == fds_before
    lock.release()


def test_timeout_error_names_the_file_with_on_error_raise(hs_dir: Path) -> None:
    path = str(hs_dir / "hs_0.safetensors")
    lock = WriterLock.create(path)
    with pytest.raises(Exception, match=r"hs_0\.safetensors"):
        list(HiddenStateReader(hs_dir, lock_timeout=0.1, on_error="raise"))
    lock.release()


def test_close_from_another_thread_interrupts_a_blocked_wait(hs_dir: Path) -> None:
    lock = WriterLock.create(str(hs_dir / "hs_0.safetensors"))
    reader = HiddenStateReader(hs_dir, lock_timeout=None)
    done = threading.Event()
    out: list[object] = []

    def consume() -> None:
        out.extend(reader)
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    assert not done.wait(0.2)  # blocked on the held lock
    reader.close()
    assert done.wait(5), "close() must end a wait on a lock that is never released"
    t.join()
    assert out == []
    lock.release()


def test_shared_lock_can_be_cancelled(hs_dir: Path) -> None:
    from hidden_state_reader.files.flockwait import CancelToken

    lock = WriterLock.create(str(hs_dir / "x.safetensors"))
    token = CancelToken()
    timer = threading.Timer(0.1, token.cancel)
    timer.start()
    with pytest.raises(WaitCancelledError):
        SharedLock.acquire(str(hs_dir / "x.safetensors"), cancel=token)
    timer.join()
    lock.release()


def test_killed_in_place_writer_leaves_a_half_file_that_is_never_yielded(hs_dir: Path) -> None:
    path = str(hs_dir / "req-1.safetensors")
    writer = start_writer("vllm-partial", path)
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "partial"
    reader = HiddenStateReader(hs_dir, lock_timeout=30)
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.extend(reader))
    t.start()
    writer.send_signal(signal.SIGKILL)  # the kernel releases its lock
    writer.wait()
    t.join(timeout=30)
    assert seen == []
    assert reader.stats.incomplete == 1
    assert os.path.exists(path), "a plain reader never deletes what it did not consume"


def test_ctrl_c_in_the_main_thread_interrupts_a_wait(hs_dir: Path) -> None:
    # A child process blocks on a held lock in its main thread; SIGINT must end it.
    path = hs_dir / "hs_0.safetensors"
    holder = start_writer("hold", str(path))
    assert holder.stdout is not None and holder.stdin is not None
    assert holder.stdout.readline().strip() == "locked"
    code = (
        "import sys; from hidden_state_reader import HiddenStateReader\n"
        "print('waiting', flush=True)\n"
        "try:\n"
        f"    list(HiddenStateReader({str(hs_dir)!r}, lock_timeout=None))\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True); sys.exit(3)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "waiting"
    # Wait until the child sleeps in flock, then interrupt it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = Path(f"/proc/{child.pid}/syscall").read_text().split()[0]
        if state == str(SYS_FLOCK_X86_64):
            break
        time.sleep(0.01)  # observing another process: nothing to block on
    child.send_signal(signal.SIGINT)
    assert child.stdout.readline().strip() == "interrupted"
    assert child.wait(timeout=10) == 3
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.wait(timeout=10) == 0
