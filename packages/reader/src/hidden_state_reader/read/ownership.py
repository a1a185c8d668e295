"""Which reader of a group takes a sample: an owner by consistent hashing, stand-ins later.

Every member of a consumer group computes the same answer from the same member list
(``read.membership``), without talking to the others: the sample's name is hashed onto a
ring of the members' points (``VNODES`` per member, so shares are even), and the members
met clockwise from it, first distinct ones first, are its **ranking**. The first is the
sample's **owner** and claims it at once; the ``k``-th (``k`` = 1, 2) is a **stand-in**
whose turn comes ``k * steal_after`` seconds after it first saw the sample; every other
member's turn comes after ``(STAND_INS + 1) * steal_after``. So in a healthy group one
reader claims each sample, and the expected claim attempts per sample do not grow with
the group; the others only look once, cheaply, when their turn comes (``decision``).

A stand-in acts when its turn comes and the sample is still there unclaimed (its owner is
dead, gone or behind: work stealing), after reaping owners that died, so that the ranking
moves on for every later sample too. Member lists can differ for up to the membership's
refresh period while readers join and leave: two readers may then both try a sample (the
claim decides), or neither at once (the stand-in takes it): never none, never two.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections.abc import Callable, Sequence

VNODES = 128
"""Points per member on the ring (the spread of shares shrinks as 1/sqrt(VNODES))."""

STAND_INS = 2
"""Ranked stand-ins per sample; later members share one last turn."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing of names over a fixed member list.

    Args:
        members: The group's members (any order; the ring depends only on the set).
    """

    def __init__(self, members: Sequence[str]) -> None:
        points = sorted((_hash(f"{m}#{v}"), m) for m in set(members) for v in range(VNODES))
        self.members = frozenset(members)
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def ranking(self, name: str, count: int) -> list[str]:
        """The first ``count`` distinct members clockwise from ``name``'s point."""
        if not self._keys:
            return []
        count = min(count, len(self.members))
        start = bisect.bisect(self._keys, _hash(name))
        out: list[str] = []
        size = len(self._owners)
        i = start
        while len(out) < count:
            member = self._owners[i % size]
            if member not in out:
                out.append(member)
            i += 1
        return out


class Ownership:
    """One member's view of which samples are its own and when it stands in for others.

    Args:
        members: Returns the group's current members (``Membership.members``).
        me: This member's name.
        steal_after: Seconds a stand-in of rank 1 waits before acting.
    """

    def __init__(self, members: Callable[[], Sequence[str]], me: str, steal_after: float) -> None:
        self._members = members
        self.me = me
        self.steal_after = steal_after
        self._ring = Ring([me])
        self._first_seen: dict[str, float] = {}
        self._seen_data: set[str] = set()

    def ring(self) -> Ring:
        """The ring over the current member list (rebuilt when it changes)."""
        members = self._members()
        if frozenset(members) != self._ring.members:
            self._ring = Ring(members)
        return self._ring

    def ranking(self, name: str) -> list[str]:
        """The owner of ``name`` and its stand-ins, in turn order."""
        return self.ring().ranking(name, STAND_INS + 1)

    def turn(self, name: str, now: float | None = None) -> float:
        """Seconds until this member may act on ``name``: 0 now (always 0 for its owner)."""
        ranking = self.ranking(name)
        if not ranking or ranking[0] == self.me:
            return 0.0
        rank = ranking.index(self.me) if self.me in ranking else len(ranking)
        now = time.monotonic() if now is None else now
        first = self._first_seen.setdefault(name, now)
        return max(0.0, first + rank * self.steal_after - now)

    def owns(self, name: str) -> bool:
        """Whether this member is the owner of ``name``."""
        ranking = self.ranking(name)
        return not ranking or ranking[0] == self.me

    def owns_as_last_seen(self, name: str) -> bool:
        """``owns`` on the ring as last built (no listing: safe on any thread, never blocks)."""
        ranking = self._ring.ranking(name, 1)
        return not ranking or ranking[0] == self.me

    def ahead_of_me(self, name: str) -> list[str]:
        """The members ranked before this one for ``name`` (whose turn came first)."""
        ranking = self.ranking(name)
        return ranking[: ranking.index(self.me)] if self.me in ranking else ranking

    def again_later(self, name: str, now: float | None = None) -> None:
        """Start ``name``'s turns afresh (its data appeared only now: owners go first)."""
        self._first_seen[name] = time.monotonic() if now is None else now

    def first_look_at_data(self, name: str) -> bool:
        """True the first time a stand-in's turn finds ``name``'s data (then it waits again).

        The turns count from when a member first heard of the sample, often its lock; the
        owner gets a whole ``steal_after`` from when the data is there before a stand-in
        takes the sample from it.
        """
        if name in self._seen_data:
            return False
        self._seen_data.add(name)
        self.again_later(name)
        return True

    def forget(self, name: str) -> None:
        """Done with ``name`` here."""
        self._first_seen.pop(name, None)
        self._seen_data.discard(name)
