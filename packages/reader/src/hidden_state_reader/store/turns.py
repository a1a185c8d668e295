"""A store follower's turns in its consumer group: claim now, look later, or leave.

Each announced sample is routed by the group's one turn rule (``read.ownership``): its
owner claims it at once; its stand-ins wait for their turn, then look with one
``batch_is_exist`` for all samples whose turn came together, and claim only a sample that
is still there unclaimed; everyone else leaves it. A follower is a member of the group
while it follows (``store.membership``). Clock: ``time.monotonic`` unless one is passed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from hidden_state_reader.format.store_keys import CommitRecord, data_key, done_key
from hidden_state_reader.read.backend import Outcome, OutcomeKind
from hidden_state_reader.read.ownership import Ownership, Route
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.membership import StoreMembership


class Entry(NamedTuple):
    """A sample the store announced: by a commit record, or found by name.

    Attributes:
        name: The sample name.
        ok: False when the producer recorded a failure instead of the sample.
        record: Its commit record (size and CRC to check), when known.
    """

    name: str
    ok: bool
    record: CommitRecord | None = None


class GroupTurns:
    """One follower's routing of announced samples within its consumer group.

    Args:
        client: The store.
        prefix: The store prefix of the samples.
        group: The consumer group.
        membership: This follower's membership of the group.
        steal_after: Seconds a stand-in of rank 1 waits before looking.
        clock: Returns the current time in seconds.
    """

    def __init__(
        self,
        client: StoreClient,
        prefix: str,
        group: str,
        membership: StoreMembership,
        steal_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._group = group
        self.membership = membership
        self._steal_after = steal_after
        self._clock = clock
        self._ownership: Ownership | None = None
        self._deferred: list[tuple[float, int, Entry]] = []  # (turn, order, entry)
        self._order = 0

    @property
    def waiting(self) -> bool:
        """Whether a sample this follower stands in for has not had its turn yet."""
        return bool(self._deferred)

    def keep_membership(self) -> None:
        """Join (again, if taken for dead) and watch the neighbour member."""
        membership = self.membership
        if not membership.joined:
            membership.join()
            self._ownership = Ownership(membership.members, membership.me, self._steal_after,
                                        others_wait=False, clock=self._clock)  # fmt: skip
        membership.watch_neighbour()

    def route(self, entry: Entry) -> Entry | Outcome | None:
        """An announced sample: this reader's to claim now, later (None), or not at all."""
        ownership = self._ownership
        if ownership is None:
            return entry
        now = self._clock()
        turn = ownership.route(entry.name, now, since=now)  # each record is announced once
        if turn.route is Route.LEAVE:
            return Outcome(OutcomeKind.OWNED_ELSEWHERE, entry.name)
        if turn.rank == 0:
            return entry  # its owner claims it at once
        # A stand-in looks when its turn comes (``due``), even a turn due at once.
        self._order += 1
        heapq.heappush(self._deferred, (turn.at, self._order, entry))
        return None

    def due(self) -> Iterator[Entry | Outcome]:
        """Stand-in turns that came: one ``batch_is_exist`` for all of them."""
        now, due = self._clock(), []
        while self._deferred and self._deferred[0][0] <= now:
            due.append(heapq.heappop(self._deferred)[2])
        if not due:
            return
        probe = [k for e in due for k in (done_key(self._prefix, self._group, e.name),
                                          data_key(self._prefix, e.name))]  # fmt: skip
        found = self._client.exists(probe)
        for i, entry in enumerate(due):
            done, data = found[2 * i], found[2 * i + 1]
            if done or (entry.ok and not data):
                yield Outcome(OutcomeKind.OWNED_ELSEWHERE, entry.name)  # its owner took it
            else:
                yield entry  # unclaimed, or its claim dies with its owner: claim it here

    def leave(self) -> None:
        """Leave the group (the pass ended)."""
        self.membership.leave()
