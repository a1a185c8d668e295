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

The turn rule itself is ``TurnSchedule.route``, pure (no clock, no files): both backends
(directory and store) route their samples through it.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

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


class Route(enum.Enum):
    """What a member does with a sample: act ``NOW``, ``LATER`` (when its turn comes), ``LEAVE``."""

    NOW = "now"
    LATER = "later"
    LEAVE = "leave"


class Turn(NamedTuple):
    """A member's turn on one sample.

    Attributes:
        route: Act now, later, or leave the sample to the others.
        at: The time (of the clock ``now`` was read from) the turn comes; ``now`` for
            ``NOW``, ``inf`` for ``LEAVE``.
        rank: 0 for the owner, ``k`` for the ``k``-th stand-in, the ranking's length for
            any other member. A stand-in whose turn came looks before it claims.
    """

    route: Route
    at: float
    rank: int = 0

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the turn (0 when it has come)."""
        return max(0.0, self.at - now)


class TurnSchedule:
    """The turn rule of a consumer group: when one member acts on a sample.

    Pure: the answer depends only on the arguments, so every member computes the same
    rule, and tests run it with any clock. The owner (rank 0) acts at once; the stand-in
    of rank ``k`` at ``since + k * steal_after``; a member outside the ranking either has
    one last turn after all stand-ins (``others_wait=True``: the directory backend, where
    every member sees every sample again on rescans) or leaves the sample
    (``others_wait=False``: the store backend, where a dead claimer's lease is taken over
    instead).

    Args:
        me: This member's name.
        steal_after: Seconds between one rank's turn and the next.
        others_wait: Whether members outside the ranking get a last turn.
    """

    def __init__(self, me: str, steal_after: float, *, others_wait: bool = True) -> None:
        self.me = me
        self.steal_after = steal_after
        self.others_wait = others_wait

    def route(self, ranking: Sequence[str], since: float, now: float) -> Turn:
        """This member's turn on a sample with ``ranking``, whose turns started ``since``.

        Args:
            ranking: The sample's owner and stand-ins, in turn order (``Ring.ranking``).
            since: When the turns started (the sample was first seen, or seen again).
            now: The current time, of the same clock as ``since``.
        """
        if not ranking or ranking[0] == self.me:
            return Turn(Route.NOW, now)
        if self.me in ranking:
            rank = ranking.index(self.me)
        elif self.others_wait:
            rank = len(ranking)
        else:
            return Turn(Route.LEAVE, float("inf"), len(ranking))
        at = since + rank * self.steal_after
        return Turn(Route.NOW, now, rank) if at <= now else Turn(Route.LATER, at, rank)


class Ownership:
    """One member's view of which samples are its own and when it stands in for others.

    Args:
        members: Returns the group's current members (``Membership.members``).
        me: This member's name.
        steal_after: Seconds a stand-in of rank 1 waits before acting.
        others_wait: Whether members outside a sample's ranking get a last turn
            (``TurnSchedule``).
        clock: Returns the current time in seconds (``time.monotonic``; tests pass a fake).
    """

    def __init__(
        self,
        members: Callable[[], Sequence[str]],
        me: str,
        steal_after: float,
        *,
        others_wait: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._members = members
        self.me = me
        self.steal_after = steal_after
        self.schedule = TurnSchedule(me, steal_after, others_wait=others_wait)
        self._clock = clock
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

    def route(self, name: str, now: float | None = None, *, since: float | None = None) -> Turn:
        """This member's turn on ``name`` (``TurnSchedule.route``).

        Args:
            name: The sample name.
            now: The current time (default: the clock's).
            since: When the turns started; default: when this member first routed
                ``name`` (remembered until ``forget`` or ``again_later``).
        """
        now = self._clock() if now is None else now
        ranking = self.ranking(name)
        if since is None and ranking and ranking[0] != self.me:
            since = self._first_seen.setdefault(name, now)
        return self.schedule.route(ranking, now if since is None else since, now)

    def turn(self, name: str, now: float | None = None) -> float:
        """Seconds until this member may act on ``name``: 0 now (always 0 for its owner)."""
        now = self._clock() if now is None else now
        return self.route(name, now).wait(now)

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
        self._first_seen[name] = self._clock() if now is None else now

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
