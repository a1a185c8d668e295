"""Where a scheduled request's sample will go: its pinned directory and its lock.

The worker pins the directory and creates the lock when the request is first
scheduled, long before the client can learn the file name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.paths import open_dir_beneath, resolve_inside


@dataclass
class SampleTarget:
    """A sample's pinned directory and its lock (None when locks are disabled).

    Attributes:
        dir_fd: Descriptor of the sample's directory, opened beneath the root.
        lock: The sample's writer lock.
    """

    dir_fd: int
    lock: WriterLock | None

    def abandon(self, reason: str) -> None:
        """Release everything for a request that will never be saved."""
        if self.lock is not None:
            self.lock.fail(reason)
        os.close(self.dir_fd)


def pin_sample(root: str, req_id: str, path: str, *, lock: bool) -> SampleTarget:
    """Open the sample's directory beneath ``root`` (no symlinks), lock the sample.

    Everything later (temp file, rename) goes through this directory descriptor, so
    swapping a path component for a symlink mid-request cannot redirect the file.

    Args:
        root: The storage root (absolute).
        req_id: vLLM request id (recorded in the lock).
        path: The sample's final data path, inside ``root``.
        lock: Create the writer lock (``use_synchronization_lock``).

    Raises:
        PathOutsideRootError: ``path`` does not resolve to itself inside ``root``.
        OSError: The directory or the lock cannot be created.
    """
    _check_inside(root, path)
    rel = os.path.relpath(os.path.realpath(os.path.dirname(path)), os.path.realpath(root))
    rel = "" if rel == "." else rel
    try:
        dir_fd = open_dir_beneath(root, rel, create=True)
    except FileNotFoundError:
        # The storage directory vanished (deleted by hand?): recreate it once.
        os.makedirs(root, exist_ok=True)
        dir_fd = open_dir_beneath(root, rel, create=True)
    try:
        writer_lock = WriterLock.create(path, dir_fd=dir_fd, request_id=req_id) if lock else None
    except BaseException:
        os.close(dir_fd)
        raise
    return SampleTarget(dir_fd, writer_lock)


def _check_inside(root: str, path: str) -> None:
    # Defence in depth: the scheduler validated it, but it crossed a process boundary.
    rel = os.path.relpath(path, root)
    if resolve_inside(root, rel) != os.path.realpath(path):
        raise PathOutsideRootError(path, root, "does not resolve to itself")
