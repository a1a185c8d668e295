"""Put one validated sample file at its exported name: a hard link, else a copy.

A hard link costs no space and no time, and the exported name keeps the very bytes that
were validated: this project's writers (and vLLM's) publish a sample by renaming a
finished file into place and never write to it again. The link is made from the path,
so it is checked against the descriptor that was validated (same device and inode);
if the name was replaced in between, or linking is impossible (another filesystem, a
filesystem without hard links), the validated descriptor's bytes are copied instead:
to a temporary name first, then renamed, so a reader never sees a partial file. The
source is never modified.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from hidden_state_reader.files.atomic import write_atomic

# Errors after which a copy still works: another filesystem, no hard links there, the
# link count of the inode at its limit, or linking refused (protected_hardlinks).
_CANNOT_LINK = {
    errno.EXDEV: "SRC and DST are on different filesystems",
    errno.EPERM: "the filesystem refused a hard link",
    errno.EMLINK: "the file has the maximum number of links",
    errno.ENOTSUP: "the filesystem has no hard links",
    errno.EOPNOTSUPP: "the filesystem has no hard links",
}


@dataclass(frozen=True)
class Placement:
    """How a file got to its exported name.

    Attributes:
        how: ``"link"`` or ``"copy"``.
        why: Why it is a copy (empty for a link).
    """

    how: str
    why: str = ""


def place(fd: int, source: str, target: str, *, copy: bool = False) -> Placement:
    """Make ``target`` hold the file open as ``fd`` (read from ``source``).

    Args:
        fd: The validated source file, open for reading.
        source: Its path (to link from).
        target: The new name; must not exist.
        copy: Copy even where a hard link is possible.

    Returns:
        Whether it is a link or a copy, and why a copy.

    Raises:
        OSError: Neither linking nor copying worked (e.g. no space left on DST).
    """
    if copy:
        copy_fd(fd, target)
        return Placement("copy", "--copy")
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        why = _CANNOT_LINK.get(exc.errno or 0)
        if why is None:
            raise
        copy_fd(fd, target)
        return Placement("copy", why)
    linked, opened = os.stat(target, follow_symlinks=False), os.fstat(fd)
    if (linked.st_dev, linked.st_ino) == (opened.st_dev, opened.st_ino):
        return Placement("link")
    os.unlink(target)  # the name now holds another file than the one validated
    copy_fd(fd, target)
    return Placement("copy", "the source name was replaced while it was exported")


def copy_fd(fd: int, target: str) -> None:
    """Copy the whole file open as ``fd`` to ``target``, published by rename.

    Raises:
        OSError: The copy failed; no file is left at ``target`` or its temporary name.
    """
    size = os.fstat(fd).st_size

    def send(out: int) -> None:
        offset = 0
        while offset < size:
            sent = os.sendfile(out, fd, offset, size - offset)
            if sent == 0:
                raise OSError(errno.EIO, f"{target}: source file shrank while copying")
            offset += sent

    write_atomic(target, send)
