"""Stages: producers on threads feeding a bounded queue, the plumbing written once.

``Stage`` runs one or more producers, each an iterable made and iterated on a thread
of its own, into one bounded queue that the consumer iterates. It holds what every
such thread needs and nothing else:

- back-pressure: at most ``capacity`` items queued, and optionally a ``budget`` of
  weighted items (``weight``) that a producer waits for with ``room()`` before it takes
  on more (a read-ahead that holds at most N samples beyond the caller's);
- stop: ``stop()`` ends every wait of the producers (and calls ``interrupt``, which ends
  waits of their own), ``close()`` also joins the threads and returns the items queued
  that the consumer never took (a claim in one is the caller's to give back);
- errors: a producer's exception is raised in the consumer's thread, where the
  consumer would have met it, after the items that producer queued before it;
- order: one producer's items arrive in its order; ``in_order`` groups (``Stages``)
  take one item from each producer in turn, as a ``DataLoader`` takes its workers'
  batches, else items arrive as they come.

Each producer's iterable is closed on its own thread (a generator is closed where it
runs). Threads are daemons: an interpreter exiting does not wait for a blocked producer.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Produce = Callable[[], Iterable[T]]
"""Makes a producer's items; called on its thread."""


class StageStoppedError(Exception):
    """Raised by ``Stage.room`` once the stage is stopping."""


class _Failed:
    """A producer's exception, queued in order (raised again by the consumer)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Stage(Generic[T]):
    """Producers on threads and one bounded queue; iterate it on the consumer's thread.

    Args:
        produce: One producer (a function making its iterable), or several.
        capacity: Items queued at most (at least 1).
        name: The threads' name (``-<index>`` added when there are several).
        budget: With ``weight``: the weight of queued items ``room()`` waits below.
        weight: An item's weight against ``budget`` (e.g. 1 for an item holding a sample).
        interrupt: Ends the producers' own waits (a cancel token), called by ``stop``.
        start: Start the threads now (else call ``start``).
    """

    def __init__(
        self,
        produce: Produce[T] | Sequence[Produce[T]],
        *,
        capacity: int,
        name: str,
        budget: int | None = None,
        weight: Callable[[T], int] | None = None,
        interrupt: Callable[[], None] | None = None,
        start: bool = True,
    ) -> None:
        produces = [produce] if callable(produce) else list(produce)
        self._capacity = max(1, capacity)
        self._budget = None if budget is None else max(1, budget)
        self._weight = weight
        self._interrupt = interrupt
        self._items: collections.deque[T | _Failed] = collections.deque()
        self._weighed = 0  # the weight of the queued items
        self._cond = threading.Condition()
        self._stopping = False
        self._running = len(produces)
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(p,),
                name=name if len(produces) == 1 else f"{name}-{i}",
                daemon=True,
            )
            for i, p in enumerate(produces)
        ]
        if start:
            self.start()

    def start(self) -> None:
        """Start the producers' threads (once)."""
        for thread in self._threads:
            thread.start()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called (a producer may look between items)."""
        return self._stopping

    def __iter__(self) -> Iterator[T]:
        """The items as they are queued; a producer's exception where it was queued."""
        while True:
            item = self._take()
            if item is None:
                return
            if isinstance(item, _Failed):
                # The traceback holds this frame: no local may keep the error (a cycle).
                error, item = item.error, None
                try:
                    raise error
                finally:
                    del error
            yield item

    def _take(self) -> T | _Failed | None:
        """The next queued item, waiting for one; None once every producer finished."""
        with self._cond:
            while not self._items and self._running:
                self._cond.wait()
            if not self._items:
                return None
            item = self._items.popleft()
            if self._weight is not None and not isinstance(item, _Failed):
                self._weighed -= self._weight(item)
            self._cond.notify_all()
            return item

    def room(self) -> None:
        """Wait until the queued items weigh less than ``budget`` (a producer calls it).

        Raises:
            StageStoppedError: The stage is stopping.
        """
        with self._cond:
            while not self._stopping and self._budget is not None and self._weighed >= self._budget:
                self._cond.wait()
            if self._stopping:
                raise StageStoppedError("stage stopped")

    def stop(self) -> None:
        """Ask the producers to stop (safe from any thread; does not wait)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._interrupt is not None:
            self._interrupt()

    def close(self) -> list[T]:
        """Stop, wait for the threads, and return the items queued that were never taken."""
        self.stop()
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join()
        with self._cond:
            left = [i for i in self._items if not isinstance(i, _Failed)]
            self._items.clear()
            self._weighed = 0
        return left

    def _put(self, item: T | _Failed) -> bool:
        """Queue ``item`` when there is room; False if the stage is stopping.

        An item made while stopping is queued anyway: ``close`` hands it back.
        """
        with self._cond:
            while not self._stopping and len(self._items) >= self._capacity:
                self._cond.wait()
            self._items.append(item)
            if self._weight is not None and not isinstance(item, _Failed):
                self._weighed += self._weight(item)
            self._cond.notify_all()
            return not self._stopping

    def _run(self, produce: Produce[T]) -> None:
        items: Any = None
        try:
            items = produce()
            for item in items:
                if not self._put(item):
                    break
        except BaseException as exc:  # raised in the consumer's thread instead
            self._put(_Failed(exc))
        finally:
            try:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # on this thread: a generator closes where it runs
            except BaseException as exc:
                self._put(_Failed(exc))
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()


class Stages(Generic[T]):
    """Several producers; with ``in_order``, one item from each in turn.

    Without ``in_order`` this is one ``Stage`` of all the producers (items as they
    come). With it, each producer has its own ``Stage`` of ``capacity`` items, and the
    consumer takes from them round-robin, skipping the ones that finished: the order
    does not depend on which thread was faster.

    Args:
        produces: The producers.
        capacity: Items each queue holds at most.
        name: The threads' name (``-<index>`` added).
        in_order: Round-robin over the producers (else as the items come).
        interrupt: Ends the producers' own waits, called by ``stop``.
        start: Start the threads now (else call ``start``).
    """

    def __init__(
        self,
        produces: Sequence[Produce[T]],
        *,
        capacity: int,
        name: str,
        in_order: bool,
        interrupt: Callable[[], None] | None = None,
        start: bool = True,
    ) -> None:
        self._interrupt = interrupt
        if in_order:
            self.stages = [
                Stage(p, capacity=capacity, name=f"{name}-{i}", start=False)
                for i, p in enumerate(produces)
            ]
        else:
            self.stages = [Stage(produces, capacity=capacity, name=name, start=False)]
        if start:
            self.start()

    def start(self) -> None:
        """Start the producers' threads (once)."""
        for stage in self.stages:
            stage.start()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called."""
        return self.stages[0].stopping

    def __iter__(self) -> Iterator[T]:
        """The items, round-robin over the producers (or as they come)."""
        live = [iter(stage) for stage in self.stages]
        while live:
            for it in list(live):
                try:
                    item = next(it)
                except StopIteration:
                    live.remove(it)
                    continue
                yield item

    def stop(self) -> None:
        """Ask every producer to stop (does not wait)."""
        for stage in self.stages:
            stage.stop()
        if self._interrupt is not None:
            self._interrupt()

    def close(self) -> list[T]:
        """Stop and join every producer; the items never taken."""
        self.stop()
        return [item for stage in self.stages for item in stage.close()]
