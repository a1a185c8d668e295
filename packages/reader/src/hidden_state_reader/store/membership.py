"""A consumer group's members in the store: a membership log and lease renewals.

The store cannot list keys, so the group's members are the replay of one log,
``members/GROUP/0, 1, 2, ...`` (``format.store_keys``), each entry taken first-put-wins:
``{"join": TOKEN, "lease": S}`` when a following reader joins (its member name is the
entry's sequence number and token), ``{"leave": MEMBER}`` when it stops, or when another
member found it dead. A member renews ``members/GROUP/SEQ/renew/1, 2, ...`` every
``lease / 4`` seconds from a background thread.

Each member replays the log at most every ``refresh`` seconds (one ``batch_is_exist``
for the next entries) and watches one other member, the next in name order: if that one
renews nothing for ``lease`` seconds of this member's own clock (no clocks are compared
across hosts), this member writes its leave entry. So the cost per member and second is
one probe of the log and one of a neighbour, whatever the size of the group. The same
members, in the same order, feed ``read.ownership`` as the directory's member files do.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from hidden_state_reader.format.store_keys import member_key, member_renewal_key
from hidden_state_reader.store.client import StoreClient

log = logging.getLogger(__name__)

_LOOKAHEAD = 8  # log entries probed past the next expected one
_WINDOW = 4  # renewals probed past the last one seen


class StoreMembership:
    """One reader's membership of its consumer group in the store.

    Args:
        client: A joined store client (thread-safe: the renewal thread uses it too).
        group: The consumer group.
        token: This reader's identity.
        lease: Seconds a member survives without a renewal.
        refresh: Seconds a replay of the log is trusted.
    """

    def __init__(
        self, client: StoreClient, group: str, token: str, lease: float, refresh: float = 0.25
    ) -> None:
        self.client = client
        self.prefix = client.settings.prefix
        self.group = group
        self.token = token
        self.lease = lease
        self.refresh = refresh
        self.me = ""  # "SEQ:TOKEN" once joined
        self._seq: int | None = None
        self._next = 0  # next log entry to read
        self._members: dict[int, str] = {}  # join seq -> member name
        self._replayed_at = float("-inf")
        self._watched: tuple[int, int, float] | None = None  # seq, renewals seen, since
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.changes = 0
        self.reaped = 0

    @property
    def joined(self) -> bool:
        """Whether this reader is a member now."""
        return self._seq is not None

    def join(self) -> None:
        """Append this reader's join entry and start renewing (idempotent)."""
        if self._seq is not None:
            return
        self._replay()
        record = json.dumps({"join": self.token, "lease": self.lease}).encode()
        seq = self._next
        while self.client.put_first(member_key(self.prefix, self.group, seq), record,
                                    full_timeout=self.lease) != record:  # fmt: skip
            seq += 1  # another reader took that entry: the next one
        self._seq, self.me = seq, f"{seq}:{self.token}"
        self._replay()
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name="hidden-state-member-lease")  # fmt: skip
        self._thread.start()

    def leave(self) -> None:
        """Append this reader's leave entry and stop renewing (idempotent)."""
        if self._seq is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._append({"leave": self.me})
        self._seq = None

    def members(self) -> tuple[str, ...]:
        """The group's members as the log says (this reader included while joined)."""
        if time.monotonic() - self._replayed_at >= self.refresh:
            self._replay()
        return tuple(sorted(self._members.values()))

    def watch_neighbour(self) -> bool:
        """Probe the next member's renewals; write its leave entry if it went silent."""
        members = self.members()
        if self._seq is None or len(members) < 2:
            self._watched = None
            return False
        neighbour = members[(members.index(self.me) + 1) % len(members)]
        seq = int(neighbour.split(":", 1)[0])
        now = time.monotonic()
        if self._watched is None or self._watched[0] != seq:
            self._watched = (seq, 0, now)
            return False
        _, seen, since = self._watched
        if now - since < self.refresh:
            return False
        keys = [member_renewal_key(self.prefix, self.group, seq, seen + i)
                for i in range(1, _WINDOW + 1)]  # fmt: skip
        found = self.client.exists(keys)
        if any(found):
            seen += max(i + 1 for i, f in enumerate(found) if f)
            self._watched = (seq, seen, now)
            return False
        if now - since < self.lease:
            self._watched = (seq, seen, since)
            return False
        log.warning("consumer group %s: member %s silent for %.1f s; it leaves the group",
                    self.group, neighbour, self.lease)  # fmt: skip
        self._append({"leave": neighbour, "by": self.me})
        self.reaped += 1
        self._watched = None
        self._replay()
        return True

    # -- the log ----------------------------------------------------------------------

    def _append(self, entry: dict[str, object]) -> None:
        record = json.dumps(entry).encode()
        self._replay()
        seq = self._next
        while self.client.put_first(member_key(self.prefix, self.group, seq), record,
                                    full_timeout=self.lease) != record:  # fmt: skip
            seq += 1
        self._replay()

    def _replay(self) -> None:
        """Read the log entries written since the last replay."""
        self._replayed_at = time.monotonic()
        before = dict(self._members)
        while True:
            keys = [member_key(self.prefix, self.group, self._next + i) for i in range(_LOOKAHEAD)]
            found = self.client.exists(keys)
            taken = 0
            for present in found:
                if not present:
                    break
                self._apply(self._next, self.client.get(member_key(self.prefix, self.group,
                                                                   self._next)))  # fmt: skip
                self._next += 1
                taken += 1
            if taken < _LOOKAHEAD:
                break
        if self._seq is not None:
            self._members.setdefault(self._seq, self.me)
        if self._members != before:
            self.changes += 1

    def _apply(self, seq: int, raw: bytes | None) -> None:
        try:
            entry = json.loads(raw or b"{}")
        except ValueError:
            return  # not an entry this version writes
        if "join" in entry:
            self._members[seq] = f"{seq}:{entry['join']}"
        elif "leave" in entry:
            left = str(entry["leave"])
            self._members = {s: m for s, m in self._members.items() if m != left}
            if left == self.me and self._seq is not None and not self._stop.is_set():
                # Found dead by a watcher (paused too long): join again as a new member.
                log.warning("consumer group %s: this reader was taken for dead; rejoining",
                            self.group)  # fmt: skip
                self._seq, self.me = None, ""

    def _renew(self) -> None:
        k = 0
        while not self._stop.wait(self.lease / 4):
            seq = self._seq
            if seq is None:
                return
            k += 1
            try:
                # One byte: Mooncake refuses empty values.
                self.client.put(member_renewal_key(self.prefix, self.group, seq, k), b"r",
                                full_timeout=self.lease / 4)  # fmt: skip
                if k > 2:  # watchers probe past the last they saw: two are enough
                    self.client.remove(member_renewal_key(self.prefix, self.group, seq, k - 2))
            except Exception as exc:  # keep renewing; a watcher may take us for dead
                log.warning("consumer group %s: cannot renew membership: %s", self.group, exc)
