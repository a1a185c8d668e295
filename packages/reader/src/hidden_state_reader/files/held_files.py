"""Files whose ``flock`` says who holds them: claim files and group member files.

The OS mechanism behind ``read.claims`` and ``read.membership`` (which keep the policy:
what a held, free or finished file means). A file is created already locked
(``create_locked``: temporary name, ``LOCK_EX``, hard link into place), taken over only
when nobody holds it (``lock_unheld``; ``try_lock_exclusive`` on a file already open),
probed without blocking (``is_held``) and removed only by a process that took its lock
(``unlink_unheld``). The kernel, or the NFS lock
manager after its lease, releases a dead process's lock, so a free lock means its holder
is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable

from hidden_state_reader.format.names import temp_path


def create_locked(path: str, fill: Callable[[int], object], *, root: str) -> int | None:
    """Create ``path`` already locked ``LOCK_EX``: the descriptor, or None if it exists.

    The file is created under a temporary name, locked, filled (``fill(fd)``) and then
    hard-linked into place, so it never appears unlocked or empty; ``link`` fails
    atomically if the name exists, also on NFS. Claims and group member files use it.
    Either thing that can vanish under it is tried again, up to three times: its folder
    (a group's claims reset by hand, ``docs/operations.md``: made again below ``root``)
    and the temporary file (removed by another process before the ``link``: a fresh one).

    Args:
        path: The file to create.
        fill: Writes the file's content to the locked descriptor.
        root: The storage root. Never made again: claims in a folder that was deleted
            (or a mount point left empty) would be claims nobody else sees.

    Raises:
        FileNotFoundError: It vanished at every try, or ``root`` is gone.
    """
    tries = 3
    while True:
        try:
            return _link_locked(path, fill)
        except FileNotFoundError:
            tries -= 1
            if not tries or not os.path.isdir(root):
                raise
            os.makedirs(os.path.dirname(path), exist_ok=True)


def _link_locked(path: str, fill: Callable[[int], object]) -> int | None:
    """One try of ``create_locked`` (``FileNotFoundError``: folder or temporary file gone)."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fill(fd)
        os.link(tmp, path)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except BaseException:
            # Linked, but the temporary name could not be removed: without this close
            # the new file would stay locked by this process and never be taken over.
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    return fd


def try_lock_exclusive(fd: int) -> bool:
    """Take ``LOCK_EX`` on the open file ``fd`` without blocking: False if it is held.

    The lock is released when the last descriptor of that open file is closed (or the
    process dies).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_unheld(path: str, *, write: bool = True) -> int | None:
    """Open ``path`` and take its ``LOCK_EX`` without blocking: the descriptor, or None.

    None when the file is gone, or was replaced between the open and the lock (the file
    locked must still be the one under that name).

    Args:
        path: The file.
        write: Open it for reading and writing (else read-only).

    Raises:
        BlockingIOError: A live process holds its lock.
    """
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # deleted meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    try:
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            os.close(fd)
            return None
    except FileNotFoundError:
        os.close(fd)
        return None
    return fd


def is_held(path: str) -> bool:
    """Whether a process holds ``path``'s ``LOCK_EX`` (False when the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # its owner holds LOCK_EX
    finally:
        os.close(fd)
    return False


def unlink_unheld(path: str) -> bool:
    """Remove ``path`` if nobody holds its lock, after taking it: True if this call did.

    False when a live process holds it, it is gone, or it was replaced meanwhile.
    """
    try:
        fd = lock_unheld(path, write=False)
    except BlockingIOError:
        return False  # alive after all
    if fd is None:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False  # removed by another process
    finally:
        os.close(fd)
    return True
