"""Exactly-once delivery across reader processes and hosts sharing one directory.

A reader claims a sample by creating ``<root>/.claims/<group>/NAME.claim``. The claim
file is created under a temporary name, locked ``LOCK_EX`` and then hard-linked into
place: ``link()`` fails if the name exists, atomically, also on NFS (where ``O_EXCL``
creation was historically unsafe). So the claim appears already locked, and:

* a claim whose lock is held belongs to a live reader: leave it;
* a claim whose lock is free and whose content says ``done`` is finished: skip it;
* a claim whose lock is free and is not ``done`` was held by a reader that died (the
  kernel, or the NFS lock manager after the lease, released its lock): take it over.

``group`` separates independent consumers of the same directory (two training jobs
that each want every sample once). A claim file's content is the same JSON status as a
lock file's (``files.locks.write_status`` / ``read_status_fd``); the ``flock`` mechanics
(create locked, take over only when free) live in ``files.held_files``.
"""

from __future__ import annotations

import contextlib
import enum
import os
from dataclasses import dataclass

from hidden_state_reader.files.held_files import create_locked, lock_unheld
from hidden_state_reader.files.identity import unique_token
from hidden_state_reader.files.locks import read_status_fd, write_status
from hidden_state_reader.format.names import CLAIMS_DIR

_DONE = "done"
_CLAIMED = "claimed"


class ClaimResult(enum.Enum):
    """Why a claim attempt did not return a claim."""

    HELD = "held"  # a live reader has it
    DONE = "done"  # someone finished it


@dataclass
class Claim:
    """A held claim on one sample; finish it with ``done`` or give it up with ``abandon``."""

    name: str
    path: str
    fd: int | None
    reclaimed: bool

    def done(self) -> None:
        """Mark the sample consumed and release the claim (idempotent).

        The state is written before the descriptor is given up, so a call cut short by
        Ctrl-C can simply be repeated.
        """
        if self.fd is None:
            return
        write_status(self.fd, _DONE)
        fd, self.fd = self.fd, None
        os.close(fd)

    def abandon(self) -> None:
        """Give the sample back: remove the claim so another reader may take it."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(fd)

    def remove(self) -> None:
        """Delete the claim file after the sample itself was deleted."""
        fd, self.fd = self.fd, None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Let go of a claim another process has settled by its path (``settle_claim_file``)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def settle_claim_file(path: str, gone: bool) -> None:
    """Settle a claim another process of this reader holds: ``done`` (or removed if ``gone``).

    The holder keeps its lock until it learns of this and calls ``Claim.release``, so no
    other reader can take the claim in between: it finds the claim held, then finished.
    Opening and closing the file here leaves the holder's ``flock`` alone.
    """
    if gone:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # the group's claims were reset by hand: nothing left to settle
    try:
        write_status(fd, _DONE)
    finally:
        os.close(fd)


class ClaimStore:
    """Claims of one consumer group over one storage root.

    Args:
        root: The storage directory.
        group: Consumer-group name; each group consumes every sample once.
    """

    def __init__(self, root: str, group: str = "default") -> None:
        if not group or "/" in group or group.startswith("."):
            raise ValueError(f"invalid claim group {group!r}")
        self.root = root
        self.directory = os.path.join(root, CLAIMS_DIR, group)
        os.makedirs(self.directory, exist_ok=True)
        self.owner = unique_token(8)

    def path_of(self, name: str) -> str:
        """The claim file of a sample."""
        return os.path.join(self.directory, name + ".claim")

    def try_claim(self, name: str) -> Claim | ClaimResult:
        """Claim a sample without blocking.

        Returns:
            A ``Claim`` if this reader now owns the sample, otherwise why not.
        """
        path = self.path_of(name)
        for _ in range(3):  # retries only for races with concurrent deletes
            if not os.path.exists(path):
                claim = self._create(name, path)
                if claim is not None:
                    return claim
            outcome = self._take_over(name, path)
            if outcome is not None:
                return outcome
        return ClaimResult.HELD

    def _create(self, name: str, path: str) -> Claim | None:
        fd = create_locked(
            path, lambda fd: write_status(fd, _CLAIMED, owner=self.owner), root=self.root
        )
        return None if fd is None else Claim(name, path, fd, reclaimed=False)

    def _take_over(self, name: str, path: str) -> Claim | ClaimResult | None:
        try:
            fd = lock_unheld(path)
        except BlockingIOError:
            return ClaimResult.HELD
        if fd is None:
            return None  # deleted or replaced meanwhile: try creating again
        if read_status_fd(fd).state == _DONE:
            os.close(fd)
            return ClaimResult.DONE
        write_status(fd, _CLAIMED, owner=self.owner, reclaimed=True)
        return Claim(name, path, fd, reclaimed=True)

    def exists(self, name: str) -> bool:
        """Whether a reader of the group has claimed the sample (held, finished or left)."""
        return os.path.exists(self.path_of(name))

    def is_done(self, name: str) -> bool:
        """Whether a sample's claim says it was consumed."""
        try:
            fd = os.open(self.path_of(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            return read_status_fd(fd).state == _DONE
        finally:
            os.close(fd)
