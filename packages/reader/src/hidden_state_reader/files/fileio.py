"""Opening files that are supposed to be regular files, without ever blocking.

A name that looks like a sample can be anything: a FIFO (``open`` would block until a
writer appears), a directory, a device. ``open_regular`` opens with ``O_NONBLOCK`` (no
effect on regular files) and refuses anything that is not a regular file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from hidden_state_reader.errors import CorruptSampleError

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class NotRegularFileError(OSError):
    """The path exists but is not a regular file."""


def open_regular(path: str) -> int:
    """Open ``path`` read-only; it must be a regular file.

    Returns:
        A file descriptor (close it).

    Raises:
        FileNotFoundError: Nothing there.
        NotRegularFileError: A FIFO, directory, socket or device.
        OSError: Other failures (permissions, symlink loops, ...).
    """
    return open_regular_stat(path)[0]


def open_regular_stat(path: str) -> tuple[int, os.stat_result]:
    """``open_regular``, with the ``fstat`` it took (size and times, without a second call).

    Raises:
        FileNotFoundError, NotRegularFileError, OSError: As ``open_regular``.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(f"{path}: not a regular file")
    return fd, st


def open_sized(path: str) -> tuple[int, int]:
    """Open ``path`` as ``open_regular`` does, with the size of its contents; no ``fstat``.

    The size is where the file ends (``lseek``): half the time of an ``fstat``, whose
    result object costs more than the call. Nothing checks that ``path`` is a regular
    file, so this is only for a caller that validates all it reads and leaves every
    failure to a second look through ``open_regular``: what else can be opened here
    fails to seek or read (a FIFO, a directory) or reads as no valid sample (a device).

    Raises:
        FileNotFoundError, OSError: It cannot be opened, or has no end to seek to.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        return fd, os.lseek(fd, 0, os.SEEK_END)
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def open_sample(path: str) -> Iterator[int]:
    """A read-only descriptor of the sample file ``path``, closed when the block ends.

    Raises:
        CorruptSampleError: Something other than a regular file is there (named).
        FileNotFoundError, OSError: It cannot be opened.
    """
    try:
        fd = open_regular(path)
    except NotRegularFileError as exc:
        raise CorruptSampleError(path, "not a regular file") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def nearest_existing(path: str) -> str:
    """``path`` if anything (even a dangling symlink) is there, else its nearest ancestor.

    That ancestor is the directory whose permissions decide whether ``path`` can be made.
    """
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current
