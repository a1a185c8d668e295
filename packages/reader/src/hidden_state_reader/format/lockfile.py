"""The lock protocol of format v1.

Writer side: ``WriterLock.create`` makes ``NAME.safetensors.lock`` appear already held
``LOCK_EX`` (it is created under a temporary name, locked, then renamed into place), so
there is no instant at which a reader can find the lock file unlocked before the data
exists. The lock file's content is a small JSON status (``writing`` with who writes:
``writer_identity``, or ``failed`` with a reason) that readers and ``hidden-state
verify`` use to tell a failed sample from a dead writer. Releasing = closing the
descriptor.

Who writes: the writer's pid, host name, the kernel's boot id, PID namespace and the
process start time (``/proc/PID/stat`` field 22). With them ``check_writer`` can tell,
on the writer's own host, that a writer is gone at once (even if its pid was reused);
elsewhere, or for a lock without them (older writers, vLLM's empty locks), it says so
and the grace period decides (``hidden_state_reader.sample.states``).

Reader side: ``SharedLock.acquire`` sleeps in ``flock(LOCK_SH)`` until the writer is
done (see ``hidden_state_reader.format.flockwait``). ``probe`` asks without blocking.

Lock files written by vLLM's own connector are empty and created in place; both sides
of this module accept them.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from hidden_state_reader.errors import CorruptSampleError
from hidden_state_reader.format.fileio import NotRegularFileError, open_regular
from hidden_state_reader.format.flockwait import CancelToken, flock_wait
from hidden_state_reader.format.names import lock_path, temp_path

STATE_WRITING = "writing"
STATE_FAILED = "failed"
_MAX_STATUS_BYTES = 4096


class LockState(enum.Enum):
    """What a non-blocking look at a lock file found."""

    ABSENT = "absent"
    FREE = "free"
    HELD = "held"


@dataclass(frozen=True)
class LockStatus:
    """The JSON status a writer left in a lock file (empty for vLLM-written locks)."""

    state: str | None
    detail: dict[str, Any]

    @property
    def failed(self) -> bool:
        """The writer gave up on this sample."""
        return self.state == STATE_FAILED

    @property
    def reason(self) -> str:
        """The writer's explanation, if any."""
        return str(self.detail.get("reason", ""))


# A small JSON object ``{"state": ..., **detail}`` in a locked file: the rule of the lock
# files here, and also of the reader's claim files (``hidden_state_reader.read.claims``).


def encode_status(state: str, **detail: Any) -> bytes:
    """The JSON status ``{"state": state, **detail}``, at most ``_MAX_STATUS_BYTES``."""
    return json.dumps({"state": state, **detail}, separators=(",", ":")).encode()[
        :_MAX_STATUS_BYTES
    ]


def write_status(fd: int, state: str, **detail: Any) -> None:
    """Replace the status in the file open as ``fd`` (the caller holds its lock)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, encode_status(state, **detail), 0)


def read_status_fd(fd: int) -> LockStatus:
    """The status in the file open as ``fd``; ``state=None`` if empty or not a status."""
    raw = os.pread(fd, _MAX_STATUS_BYTES, 0)
    try:
        doc = json.loads(raw) if raw.strip() else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    state = doc.pop("state", None)
    return LockStatus(state if isinstance(state, str) else None, doc)


_PROC = "/proc"


def _read_proc(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


@functools.cache
def _boot_id() -> str | None:
    """The running kernel's boot id (None where there is no /proc)."""
    return _read_proc(f"{_PROC}/sys/kernel/random/boot_id")


def _pid_namespace() -> str | None:
    """This process's PID namespace, e.g. ``pid:[4026531836]`` (None without /proc)."""
    try:
        return os.readlink(f"{_PROC}/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessSeen:
    """What ``/proc/PID/stat`` says of a live pid: its start time and whether it is a zombie."""

    start_ticks: int
    zombie: bool


def process_seen(pid: int) -> ProcessSeen | None:
    """Look up ``pid`` in ``/proc``; None when no such process exists (or no /proc)."""
    raw = _read_proc(f"{_PROC}/{pid}/stat")
    if raw is None:
        return None
    # "PID (COMM) STATE ..." where COMM may hold spaces and parentheses: split after the
    # last ")"; field 3 (state) is then the first and field 22 (starttime) the 20th.
    fields = raw[raw.rfind(")") + 1 :].split()
    try:
        return ProcessSeen(int(fields[19]), fields[0] in ("Z", "X"))
    except (IndexError, ValueError):
        return None


def writer_identity() -> dict[str, Any]:
    """Who the calling process is, as a lock records it.

    ``pid`` and ``host`` always; where ``/proc`` exists also ``boot_id`` (the running
    kernel), ``pid_ns`` (the PID namespace, so a container's pids are not looked up in
    another's) and ``start_ticks`` (the process start time in clock ticks after boot,
    ``/proc/PID/stat`` field 22: a reused pid has another one).
    """
    return {"pid": os.getpid(), "host": socket.gethostname(), **_process_facts(os.getpid())}


@functools.cache
def _process_facts(pid: int) -> dict[str, Any]:
    """``boot_id``, ``pid_ns`` and ``start_ticks`` of this process; {} without ``/proc``.

    Looked up once per pid: a forked child is another pid, with its own start time.
    """
    boot, pid_ns, seen = _boot_id(), _pid_namespace(), process_seen(pid)
    if boot is None or pid_ns is None or seen is None:
        return {}
    return {"boot_id": boot, "pid_ns": pid_ns, "start_ticks": seen.start_ticks}


class WriterFate(enum.Enum):
    """What can be known about the process that wrote a lock's ``writing`` status."""

    RUNNING = "running"
    """It ran on this host and is still running."""
    GONE = "gone"
    """It ran on this host and is gone (exited, killed, or its pid reused): it will never
    publish the sample."""
    ELSEWHERE = "elsewhere"
    """It ran on another host (or in another PID namespace): it cannot be checked here."""
    UNKNOWN = "unknown"
    """The lock does not say which process wrote it (an older writer, vLLM's lock)."""


@dataclass(frozen=True)
class WriterCheck:
    """The fate of a lock's writer and how it was told, in a few words (``why``)."""

    fate: WriterFate
    why: str


def check_writer(status: LockStatus | None) -> WriterCheck:
    """What can be known, from here, about the writer that left ``status`` in a lock.

    On the writer's own host (same boot id and PID namespace) its pid is looked up in
    ``/proc``: gone, a zombie, or a process with another start time means the writer is
    gone. Another boot id is another host (or this one before a restart: host names are
    no proof, containers on several nodes share them), so the grace period decides.
    """
    detail = status.detail if status is not None else {}
    pid, host = detail.get("pid"), detail.get("host")
    boot, pid_ns, ticks = detail.get("boot_id"), detail.get("pid_ns"), detail.get("start_ticks")
    if not (isinstance(pid, int) and isinstance(boot, str) and isinstance(ticks, int)):
        why = "the lock does not record its writer's process (an older writer, or vLLM's)"
        return WriterCheck(WriterFate.UNKNOWN, why)
    if boot != _boot_id():
        return WriterCheck(
            WriterFate.ELSEWHERE, f"its writer (pid {pid}) ran on host {host}: not checkable here"
        )
    if pid_ns != _pid_namespace():
        why = f"its writer (pid {pid}) ran in another PID namespace of this host: not checkable"
        return WriterCheck(WriterFate.ELSEWHERE, why)
    seen = process_seen(pid)
    if seen is None or seen.zombie:
        return WriterCheck(WriterFate.GONE, f"its writer (pid {pid} on this host) is gone")
    if seen.start_ticks != ticks:
        why = f"its writer (pid {pid} on this host) is gone; the pid now names another process"
        return WriterCheck(WriterFate.GONE, why)
    return WriterCheck(WriterFate.RUNNING, f"its writer (pid {pid} on this host) is running")


class WriterLock:
    """An exclusive lock a writer holds on a sample until it is final (or failed)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, data_path: str, *, dir_fd: int | None = None, **detail: Any) -> WriterLock:
        """Create ``data_path + '.lock'`` already locked ``LOCK_EX``.

        Never blocks: the lock is taken on a fresh inode before it gets its public name,
        and the rename replaces any older lock file of the same name (a reader still
        holding that old inode is unaffected).

        Args:
            data_path: The sample's final data path.
            dir_fd: A descriptor of the sample's directory: create the lock there, by
                name, whatever the directory's path now leads to.
            **detail: JSON-serialisable facts recorded in the status (request id, ...).

        Raises:
            OSError: The file cannot be created (permissions, full disk, missing dir).
        """
        final = lock_path(data_path)
        tmp = temp_path(final)
        if dir_fd is not None:
            final_name, tmp_name = os.path.basename(final), os.path.basename(tmp)
        else:
            final_name, tmp_name = final, tmp
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(tmp_name, flags, 0o644, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_status(fd, STATE_WRITING, **writer_identity(), **detail)
            os.replace(tmp_name, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
        return cls(final, fd)

    @classmethod
    def adopt(cls, data_path: str, fd: int) -> WriterLock:
        """Wrap a descriptor that already holds ``LOCK_EX`` on the sample's lock file."""
        return cls(lock_path(data_path), fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def mark_failed(self, reason: str, **detail: Any) -> None:
        """Record in the lock file why the sample will never appear (best effort)."""
        if self._fd is None:
            return
        # A full disk must not turn a failed sample into a crash.
        with contextlib.suppress(OSError):
            write_status(self._fd, STATE_FAILED, reason=reason[:1000], pid=os.getpid(), **detail)

    def release(self) -> None:
        """Release the lock (idempotent). Readers sleeping on it wake now."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def fail(self, reason: str, **detail: Any) -> None:
        """Record why the sample will never appear, then release (idempotent).

        Readers sleeping on the lock wake and read ``reason``; once released, a later
        call changes nothing (the first reason stays).
        """
        self.mark_failed(reason, **detail)
        self.release()


def read_status(path: str) -> LockStatus:
    """Read the status a writer left in a lock file (``state=None`` if empty/foreign)."""
    try:
        fd = open_regular(path)
    except (FileNotFoundError, NotRegularFileError):
        return LockStatus(None, {})
    try:
        return read_status_fd(fd)
    finally:
        os.close(fd)


def probe(path: str) -> LockState:
    """Look at a lock file without blocking."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return LockState.ABSENT
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return LockState.HELD
    finally:
        os.close(fd)
    return LockState.FREE


class SharedLock:
    """A reader's ``LOCK_SH`` on a sample's lock file, held while the data is read."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @property
    def existed(self) -> bool:
        """False when there was no lock file (a lock-less dataset, or cleaned up)."""
        return self._fd is not None

    @classmethod
    def acquire(
        cls,
        data_path: str,
        *,
        timeout: float | None = None,
        cancel: CancelToken | None = None,
    ) -> SharedLock | None:
        """Sleep until the sample's writer has released its lock.

        Args:
            data_path: The sample's data path.
            timeout: Seconds to wait at most; None waits until the writer is done.
            cancel: Ends the wait early from another thread.

        Returns:
            The held shared lock (``existed`` False if there is no lock file), or None if
            the timeout ran out while the writer still held the lock.

        Raises:
            WaitCancelledError: Cancelled through ``cancel``.
        """
        path = lock_path(data_path)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            return cls(path, None)
        except NotRegularFileError as exc:
            raise CorruptSampleError(data_path, "its lock file is not a regular file") from exc
        try:
            if not flock_wait(fd, timeout=timeout, cancel=cancel):
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Release the shared lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SharedLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
