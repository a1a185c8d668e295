"""Samples a reader waits for: held by a writer, or due for another look.

``Waiting`` is bookkeeping only (no I/O, no threads; each call costs O(log n) in the
samples waited for, so a follower of a busy group with many samples left to other
members stays cheap): for each sample it remembers
whether a writer held its lock when last looked at, when ``lock_timeout`` runs out for
it, and when to look again. A look is due when

* a file-system event touched the sample (its lock was closed after writing, its data
  renamed into place): the caller calls ``touch``;
* a scheduled re-look is due: a sample that may still be coming without a lock (young
  lock, growing lock-less file), one another reader had claimed, or — where there are
  no file-system events (``watch="poll"``) — a held lock every ``poll_interval``.

The kernel signals a lock release (IN_CLOSE_WRITE) a moment *before* it drops the lock,
so a look right after a touch can still find the lock held. Only then, a few re-looks
follow at growing delays (``RACE_RECHECKS``); there is no fixed-interval polling of
locks while events are received.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass

RACE_RECHECKS = (0.001, 0.004, 0.016, 0.064)
"""Delays of the re-looks after a touch that still found the lock held, seconds."""


@dataclass
class _Entry:
    held: bool
    deadline: float | None = None  # lock_timeout runs out (None: never, or reported)
    recheck: float | None = None  # next look (None: wait for a touch)
    touched: bool = False
    races: int = 0  # re-looks made since the last touch


class Waiting:
    """Undecided samples of one reader.

    Args:
        lock_timeout: Seconds a writer may hold one sample's lock (None: forever).
        poll_interval: Re-look at held locks this often (None while file-system events
            are received).
    """

    def __init__(self, lock_timeout: float | None, poll_interval: float | None) -> None:
        self.lock_timeout = lock_timeout
        self.poll_interval = poll_interval
        self._entries: dict[str, _Entry] = {}
        # Re-looks and deadlines in time order; an item is live while it matches its
        # entry (stale ones are skipped when they come up).
        self._rechecks: list[tuple[float, str]] = []
        self._deadlines: list[tuple[float, str]] = []

    def _schedule(self, name: str, entry: _Entry, recheck: float | None) -> None:
        entry.recheck = recheck
        if recheck is not None:
            heapq.heappush(self._rechecks, (recheck, name))

    def _live_recheck(self) -> tuple[float, str] | None:
        """The soonest live re-look, dropping stale heap items on the way."""
        heap = self._rechecks
        while heap:
            at, name = heap[0]
            entry = self._entries.get(name)
            if entry is not None and entry.recheck == at:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _live_deadline(self) -> tuple[float, str] | None:
        heap = self._deadlines
        while heap:
            at, name = heap[0]
            entry = self._entries.get(name)
            if entry is not None and entry.held and entry.deadline == at:
                return heap[0]
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def held_names(self) -> list[str]:
        """Samples whose writer held the lock at the last look."""
        return [n for n, e in self._entries.items() if e.held]

    def held(self, name: str, now: float | None = None) -> None:
        """A look found the writer still holding ``name``'s lock."""
        now = time.monotonic() if now is None else now
        entry = self._entries.get(name)
        if entry is None or not entry.held:
            deadline = None if self.lock_timeout is None else now + self.lock_timeout
            entry = self._entries[name] = _Entry(held=True, deadline=deadline)
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, name))
        if entry.touched:
            entry.touched, entry.races = False, 0
            racing = True
        else:
            racing = 0 < entry.races < len(RACE_RECHECKS)
        if racing:
            self._schedule(name, entry, now + RACE_RECHECKS[entry.races])
            entry.races += 1
        elif self.poll_interval is not None:
            self._schedule(name, entry, now + self.poll_interval)
        else:
            entry.recheck = None

    def later(self, name: str, delay: float, now: float | None = None) -> None:
        """Look at ``name`` again in ``delay`` seconds (or when touched)."""
        now = time.monotonic() if now is None else now
        entry = self._entries[name] = _Entry(held=False)
        self._schedule(name, entry, now + max(0.0, delay))

    def touch(self, names: Iterable[str], now: float | None = None) -> list[str]:
        """Mark the awaited ones among ``names`` due now; returns them."""
        if not self._entries:
            return []
        now = time.monotonic() if now is None else now
        due = []
        for name in names:
            entry = self._entries.get(name)
            if entry is not None:
                entry.touched = True
                self._schedule(name, entry, now)
                due.append(name)
        return due

    def touch_all(self, now: float | None = None) -> list[str]:
        """Mark every awaited sample due now (events may have been missed)."""
        return self.touch(list(self._entries), now)

    def due(self, now: float | None = None) -> list[str]:
        """Samples whose next look is due, soonest first (each handed out once)."""
        if not self._rechecks:
            return []
        now = time.monotonic() if now is None else now
        ready = []
        while (item := self._live_recheck()) is not None and item[0] <= now:
            heapq.heappop(self._rechecks)
            self._entries[item[1]].recheck = None
            ready.append(item[1])
        return ready

    def expired(self, now: float | None = None) -> list[str]:
        """Held samples whose ``lock_timeout`` ran out (each reported once)."""
        now = time.monotonic() if now is None else now
        out = []
        while (item := self._live_deadline()) is not None and item[0] <= now:
            heapq.heappop(self._deadlines)
            self._entries[item[1]].deadline = None
            out.append(item[1])
        return out

    def drop(self, name: str) -> None:
        """Forget ``name`` (decided, or given up)."""
        self._entries.pop(name, None)

    def next_time(self) -> float | None:
        """The soonest re-look or deadline, monotonic time (None: wait for touches)."""
        times = [item[0] for item in (self._live_recheck(), self._live_deadline()) if item]
        return min(times) if times else None
