"""Samples in completion order: many writers waited for at once, none blocking another.

``CompletionStream`` turns a source of names (``sources``) into decided outcomes
(``decision``). Every sample is looked at without waiting; one whose writer still holds
the lock goes into ``waiting_set.Waiting`` and is looked at again when the kernel says one
of its files changed (its lock closed after writing, its data renamed into place), so
each sample comes out as soon as it is complete, in the order samples completed, while
others are still being written. ``flock`` stays the truth: an event only causes a look.

* ``lock_timeout`` runs per sample from the first look that found it held; it never
  delays another sample. When it runs out a ``TIMED_OUT`` outcome is emitted once; a
  follower keeps the sample and still yields it if its writer finishes later, a
  snapshot drops it.
* ``idle_timeout`` (follow mode) ends the stream after that long without a sample
  becoming ready (yielded or rejected); a pending sample is no news.
* A snapshot ends when every name is decided. While it waits for exactly one writer
  and nothing else can happen, it sleeps in ``flock`` itself (the kernel wakes it on
  release); with several it watches the directory (unless ``watch="poll"``).
* Where no file-system events arrive (``watch="poll"``, or watching failed), held
  locks are looked at every ``poll_interval``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator

from hidden_state_reader.errors import LockTimeoutError, WaitCancelledError
from hidden_state_reader.files.flockwait import CancelToken
from hidden_state_reader.read.backend import Outcome, OutcomeKind
from hidden_state_reader.read.decision import Decider
from hidden_state_reader.read.sources import FollowSource, SnapshotSource
from hidden_state_reader.read.waiting_set import Waiting

_WAITING_KINDS = (OutcomeKind.PENDING, OutcomeKind.RECHECK)


class CompletionStream:
    """Decided outcomes of a directory's samples, in completion order.

    Args:
        source: Where names (and touches) come from.
        decider: Makes the per-sample decision.
        cancel: Ends the stream (``close()``) and interrupts a wait in progress.
        lock_timeout: Seconds to wait for one sample's writer (None: forever).
        idle_timeout: Follow mode: end after this long without a sample becoming ready.
        poll_interval: Look at held locks this often when no events are received.
    """

    def __init__(
        self,
        source: SnapshotSource | FollowSource,
        decider: Decider,
        cancel: CancelToken,
        *,
        lock_timeout: float | None,
        idle_timeout: float | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        self.source = source
        self.decider = decider
        self.follow = isinstance(source, FollowSource)
        self._cancel = cancel
        self._idle_timeout = idle_timeout if self.follow else None
        self._poll_interval = poll_interval
        # A snapshot starts watching (or polling) only once it waits for several writers.
        polling = self.follow and not source.watching
        self.waiting = Waiting(lock_timeout, poll_interval if polling else None)
        self._todo: deque[str] = deque()
        self._queued: set[str] = set()
        self.last_ready = time.monotonic()

    def _enqueue(self, names: list[str]) -> None:
        for name in names:
            if name not in self._queued:
                self._queued.add(name)
                self._todo.append(name)

    def _gather(self) -> None:
        if self.decider.group_changed() and isinstance(self.source, FollowSource):
            self.source.set_batch_window(self.decider.event_batch_window())
            # Members joined, left or died: a sample left to one that is gone has a new
            # owner now, who must hear of it again.
            self._enqueue(self.source.present())
        fresh, touched = self.source.take()
        if fresh:
            self._enqueue(fresh)
        if self.waiting:
            self._enqueue(self.waiting.touch(touched))
            self._enqueue(self.waiting.due())

    def __iter__(self) -> Iterator[Outcome]:
        try:
            while not self._cancel.cancelled:
                self._gather()
                while self._todo and not self._cancel.cancelled:
                    name = self._todo.popleft()
                    self._queued.discard(name)
                    decided = self.decider.decide(name, 0.0, self._cancel)
                    outcome: Outcome | None = decided
                    if decided.kind is OutcomeKind.YIELD:  # the common case, inline
                        self.waiting.drop(name)
                    else:
                        outcome = self._decided(name, decided)
                    if outcome is not None:
                        yield outcome
                        if self._idle_timeout is not None and outcome.kind is OutcomeKind.YIELD:
                            self.last_ready = time.monotonic()  # the caller's time is not idle
                    if self.follow or self.waiting or self.source.watching:
                        # (A snapshot that waits for nothing and watches nothing has had
                        # its one batch of names: nothing can be new.)
                        self._gather()
                yield from self._timeouts()
                if not self.follow and not self.waiting:
                    return
                if not self._wait():
                    return
        except WaitCancelledError:
            return

    def _decided(self, name: str, outcome: Outcome) -> Outcome | None:
        """Book a decision other than ``YIELD``; None if the sample is (still) waited for."""
        kind = outcome.kind
        if kind is OutcomeKind.PENDING:
            self.waiting.held(name)
            return None
        if kind is OutcomeKind.RECHECK:
            self.waiting.later(name, outcome.delay)
            return None
        if kind is OutcomeKind.DEFERRED:
            self.waiting.later(name, outcome.delay)
            return None
        if kind is OutcomeKind.CLAIMED:
            self.waiting.later(name, outcome.delay)
        else:
            self.waiting.drop(name)
        if kind is OutcomeKind.REJECT:
            self.last_ready = time.monotonic()
        return outcome

    def _timeouts(self) -> Iterator[Outcome]:
        for name in self.waiting.expired():
            if not self.follow:
                self.waiting.drop(name)
            error = LockTimeoutError(
                os.path.join(self.decider.root, name),
                f"writer still holds the lock after {self.waiting.lock_timeout}s",
            )
            yield Outcome(OutcomeKind.TIMED_OUT, name, error=error)

    def _wait(self) -> bool:
        """Sleep until something may have changed; False when the stream should end."""
        now = time.monotonic()
        until = self.waiting.next_time()
        if self._idle_timeout is not None:
            idle_end = self.last_ready + self._idle_timeout
            if now >= idle_end:
                return False
            until = _earliest(until, idle_end)
        if isinstance(self.source, SnapshotSource):
            held = self.waiting.held_names()
            if len(held) == 1 and len(self.waiting) == 1:
                self._sleep_in_flock(held[0], until)
                return not self._cancel.cancelled
            if not self.source.watching and self.waiting.poll_interval is None:
                # Several to wait for: watch the directory, or poll if that is impossible.
                # Changes from before the watch began went unseen: look at all once.
                if not self.source.watch():
                    self.waiting.poll_interval = self._poll_interval
                self._enqueue(self.waiting.touch_all())
                return True
        self.source.wait(until)
        return not self.source.closed

    def _sleep_in_flock(self, name: str, until: float | None) -> None:
        """The one thing left to wait for is one writer: let the kernel wake us."""
        timeout = None if until is None else max(0.0, until - time.monotonic())
        path = os.path.join(self.decider.root, name)
        lock = self.decider.lock_type.acquire(path, timeout=timeout, cancel=self._cancel)
        if lock is not None:
            lock.release()
            self._enqueue(self.waiting.touch([name]))


def _earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two optional times."""
    return b if a is None else a if b is None else min(a, b)
