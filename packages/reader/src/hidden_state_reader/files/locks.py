"""The lock protocol of format v1: taking, holding and reading lock files.

Writer side: ``WriterLock.create`` makes ``NAME.safetensors.lock`` appear already held
``LOCK_EX`` (it is created under a temporary name, locked, then renamed into place), so
there is no instant at which a reader can find the lock file unlocked before the data
exists. The lock file's content is a small JSON status (``writing`` with who writes:
``writer_identity``, or ``failed`` with a reason) that readers and ``hidden-state
verify`` use to tell a failed sample from a dead writer. Releasing = closing the
descriptor.

Who writes is the process identity (``hidden_state_reader.files.identity``); what a
status holds is the format's lock-status schema (``hidden_state_reader.format.lock_status``).

Reader side: ``SharedLock.acquire`` sleeps in ``flock(LOCK_SH)`` until the writer is
done (see ``hidden_state_reader.files.flockwait``). ``probe`` asks without blocking.

Lock files written by vLLM's own connector are empty and created in place; both sides
of this module accept them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any

from hidden_state_reader.errors import CorruptSampleError
from hidden_state_reader.files.fileio import NotRegularFileError, open_regular
from hidden_state_reader.files.flockwait import CancelToken, flock_wait
from hidden_state_reader.files.identity import writer_identity
from hidden_state_reader.format.lock_status import (
    MAX_STATUS_BYTES,
    STATE_FAILED,
    STATE_WRITING,
    LockState,
    LockStatus,
    decode_status,
    encode_status,
)
from hidden_state_reader.format.names import lock_path, temp_path


def write_status(fd: int, state: str, **detail: Any) -> None:
    """Replace the status in the file open as ``fd`` (the caller holds its lock)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, encode_status(state, **detail), 0)


def read_status_fd(fd: int) -> LockStatus:
    """The status in the file open as ``fd``; ``state=None`` if empty or not a status."""
    return decode_status(os.pread(fd, MAX_STATUS_BYTES, 0))


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
