"""Who follows a directory as one consumer group: member files held under ``flock``.

A reader joins its group by creating ``<root>/.claims/.members/<group>/<member>`` the way
claims are created (temporary name, ``LOCK_EX``, hard link into place), so the file
appears already locked, and keeps it locked while it follows. The kernel (or the NFS lock
manager, after its lease) releases the lock when the reader's process dies, so:

* a member file whose lock is held is a live member;
* a member file whose lock is free belongs to a reader that died: any member may remove
  it (``reap``), after taking the lock itself, so a live member is never removed;
* a reader that stops following removes its own file (``leave``).

Members see the group by listing the folder (``members``: at most once per ``refresh``
seconds, one ``getdents`` per reader; a joiner's temporary file is no member). Liveness
is probed only where it matters: the member a reader watches (the next one in name
order, ``neighbour``: one probe per ``refresh``, so every member is watched by one other
and a death is noticed within about ``refresh`` seconds), and the owners a stand-in is
about to act for (``read.ownership``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from hidden_state_reader.files.held_files import create_locked, is_held, unlink_unheld
from hidden_state_reader.files.identity import process_record
from hidden_state_reader.format.names import is_temp_name

MEMBERS_DIR = ".members"
"""The folder of the groups' member folders inside ``.claims`` (no group name starts with
a dot, so it never is a group's claims folder)."""


class Membership:
    """One reader's membership of its consumer group, and the group as it sees it.

    Args:
        claims_root: The claims folder of the storage root (``<root>/.claims``).
        group: The consumer group.
        member: This reader's member name (unique per reader: host, pid, random).
        refresh: Seconds a listing (and a liveness probe) is trusted.
    """

    def __init__(self, claims_root: str, group: str, member: str, refresh: float = 0.25) -> None:
        self.claims_root = claims_root
        self.directory = os.path.join(claims_root, MEMBERS_DIR, group)
        self.me = member
        self.refresh = refresh
        self._fd: int | None = None
        self._members: tuple[str, ...] = (member,)
        self._listed_at = float("-inf")
        self._alive: dict[str, tuple[bool, float]] = {}
        self.changes = 0  # how often the listing changed since joining
        self.reaped = 0

    @property
    def joined(self) -> bool:
        """Whether this reader's member file exists and is held."""
        return self._fd is not None

    def join(self) -> None:
        """Create and lock this reader's member file (idempotent)."""
        if self._fd is not None:
            return
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, self.me)
        record = {**process_record(), "since": time.time()}
        fd = create_locked(
            path,
            lambda fd: os.write(fd, json.dumps(record).encode()),
            root=os.path.dirname(os.path.normpath(self.claims_root)),
        )
        if fd is None:
            raise FileExistsError(f"group member file exists already: {path}")
        self._fd = fd
        self._listed_at = float("-inf")

    def leave(self) -> None:
        """Remove this reader's member file: the others take over its share (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, self.me))
        os.close(fd)

    def members(self) -> tuple[str, ...]:
        """The group's members in name order (this reader included while it is joined)."""
        now = time.monotonic()
        if now - self._listed_at >= self.refresh:
            self._listed_at = now
            try:
                # A joiner's temporary file is no member: it exists unlocked until the
                # joiner locks it, and reaping it as dead would make the joiner's link
                # fail (``create_locked``).
                names = [
                    n
                    for n in os.listdir(self.directory)
                    if not n.startswith(".") and not is_temp_name(n)
                ]
            except FileNotFoundError:
                names = []
            if self._fd is not None and self.me not in names:
                names.append(self.me)  # the listing raced with our own join
            listed = tuple(sorted(names))
            if listed != self._members:
                self._members = listed
                self.changes += 1
        return self._members

    def neighbour(self) -> str | None:
        """The member this reader watches: the next one in name order (None when alone)."""
        members = self.members()
        if len(members) < 2 or self.me not in members:
            return None
        return members[(members.index(self.me) + 1) % len(members)]

    def alive(self, member: str) -> bool:
        """Whether ``member`` holds its member file (probed at most once per ``refresh``)."""
        if member == self.me:
            return self._fd is not None
        now = time.monotonic()
        known = self._alive.get(member)
        if known is not None and now - known[1] < self.refresh:
            return known[0]
        alive = self._probe(member)
        self._alive[member] = (alive, now)
        return alive

    def _probe(self, member: str) -> bool:
        return is_held(os.path.join(self.directory, member))

    def reap(self, member: str) -> bool:
        """Remove the member file of a dead reader; True if this call removed it."""
        if not unlink_unheld(os.path.join(self.directory, member)):
            return False  # alive after all, replaced, or reaped by another member
        self.reaped += 1
        self._alive.pop(member, None)
        self._listed_at = float("-inf")  # list again now
        return True

    def watch_neighbour(self) -> bool:
        """Probe the watched member; reap it if it died. True if one was reaped."""
        member = self.neighbour()
        if member is None or self.alive(member):
            return False
        return self.reap(member)
