"""Publishing by rename, the one home of it: no reader ever sees half a file.

- ``write_atomic``: write a whole file under a temporary name (``format.names.temp_path``,
  a name readers ignore), fsync it when asked, rename it into place (``os.replace``)
  and fsync its directory when asked; on any failure the temporary file is removed and
  nothing is left at the final name that was not there before.
- ``move``: rename a file into another place (a consumed sample into its done folder, a
  rejected one into quarantine).
- ``publish_directory``: rename a directory built aside into place (an export).

A sample file streamed chunk by chunk under its lock is published by
``files.publish.SampleFileWriter`` and a lock file by ``files.locks.WriterLock``: both
rename relative to a pinned directory descriptor, which this module's callers need not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from hidden_state_reader.format.names import temp_path


def write_atomic(
    path: str, content: bytes | Callable[[int], object], *, fsync: bool = False
) -> None:
    """Write ``path`` whole: temporary file, fsync as asked, rename, unlink on failure.

    Args:
        path: The final name (an existing file there is replaced atomically).
        content: The bytes to write, or ``fill(fd)``: writes the file through the
            descriptor open for writing (for a copy with ``sendfile``).
        fsync: Make the file and its directory entry durable before returning.

    Raises:
        OSError: The file could not be written; ``path`` is as it was and no
            temporary file is left.
    """
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if callable(content):
                content(fd)
            else:
                _write_all(fd, content)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        sync_directory(os.path.dirname(path) or ".")


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is not an error)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def sync_directory(directory: str) -> None:
    """Make the names renamed into ``directory`` durable (fsync the directory)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move(source: str, target: str) -> None:
    """Rename ``source`` to ``target``, replacing a file there (``os.replace``).

    Raises:
        FileNotFoundError: ``source`` (or ``target``'s folder) is gone.
    """
    os.replace(source, target)


def publish_directory(staging: str, target: str) -> None:
    """Rename the directory ``staging`` to ``target``, which is absent or an empty folder.

    Raises:
        OSError: ``target`` is not empty (or became a file meanwhile: fails loudly).
    """
    if os.path.isdir(target):
        os.rmdir(target)  # empty; anything put there since makes this fail
    os.rename(staging, target)
