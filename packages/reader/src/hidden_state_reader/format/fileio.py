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
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(f"{path}: not a regular file")
    return fd, st


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
