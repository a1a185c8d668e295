"""Read ahead: decide about the next sample in a thread while the caller uses this one.

A store sample costs a reader round trips to the master (commit log, claim) and a
transfer (``get_into``, which releases the GIL but keeps its calling thread busy
polling for completion), then a CRC32. Done in the caller's thread, all of it adds to
every step of a training loop; done by a thread of its own, it overlaps with the step.

``ReadAhead`` runs a backend pass (a generator of decisions) in one daemon thread and
hands its items over in order. Before it claims and reads a sample, the pass calls
``room``, which waits until fewer than ``samples`` items holding a sample are queued:
so a reader holds at most ``samples`` samples (and their claims) beyond the one its
caller is using, and the memory it holds is bounded. Other items (another reader's
sample, a failure record) are tiny and are bounded separately. An exception of the
pass is raised in the caller's thread, where the caller would have met it. ``close``
stops the thread and returns the items it produced that the caller never took: their
claims are the caller's to give back.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Generic, TypeVar

from hidden_state_reader.errors import WaitCancelledError

T = TypeVar("T")

Room = Callable[[], None]
"""``room()``: wait until the pass may read one more sample ahead (``WaitCancelledError``
when the read-ahead is closing)."""

_MAX_QUEUED = 1024  # items queued ahead of the caller, whatever they hold


class ReadAhead(Generic[T]):
    """A backend pass running in a thread, ``samples`` samples ahead at most.

    Args:
        source: Makes the pass, given ``room`` (it calls it before each sample it
            reads); the pass runs (and is closed) in the thread.
        holds_sample: Whether an item holds a sample's memory (what ``samples`` counts).
        samples: Items holding a sample queued ahead of the caller (at least 1).
        interrupt: Ends a wait of the pass in progress (its cancel token), for ``close``.
        name: The thread's name.
    """

    def __init__(
        self,
        source: Callable[[Room], Generator[T, None, None]],
        *,
        holds_sample: Callable[[T], bool],
        samples: int,
        interrupt: Callable[[], None],
        name: str = "hidden-state-read-ahead",
    ) -> None:
        self._holds_sample = holds_sample
        self._samples = max(1, samples)
        self._interrupt = interrupt
        self._items: collections.deque[T] = collections.deque()
        self._loaded = 0  # queued items that hold a sample
        self._cond = threading.Condition()
        self._stopping = False
        self._finished = False
        self._error: BaseException | None = None
        self._source = source(self.room)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        """The pass's items, in order; the pass's exception, if it raised one."""
        while True:
            with self._cond:
                while not self._items and not self._finished:
                    self._cond.wait()
                if not self._items:
                    if self._error is not None:
                        error, self._error = self._error, None
                        raise error
                    return
                item = self._items.popleft()
                self._loaded -= self._holds_sample(item)
                self._cond.notify_all()
            yield item

    def room(self) -> None:
        """Wait until fewer than ``samples`` items holding a sample are queued (the pass).

        Raises:
            WaitCancelledError: The read-ahead is closing.
        """
        with self._cond:
            while not self._stopping and self._loaded >= self._samples:
                self._cond.wait()
            if self._stopping:
                raise WaitCancelledError("read-ahead closed")

    def stop(self) -> None:
        """Ask the thread to stop reading ahead (safe from any thread; does not wait)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._interrupt()

    def close(self) -> list[T]:
        """Stop the thread (after the store call it is in, if any); the items not taken."""
        self.stop()
        self._thread.join()
        with self._cond:
            left, self._items = list(self._items), collections.deque()
            self._loaded = 0
        return left

    def _run(self) -> None:
        try:
            for item in self._source:
                with self._cond:
                    while not self._stopping and len(self._items) >= _MAX_QUEUED:
                        self._cond.wait()
                    # Queued even when stopping: ``close`` hands it back (its claim).
                    self._items.append(item)
                    self._loaded += self._holds_sample(item)
                    self._cond.notify_all()
                    if self._stopping:
                        break
        except BaseException as exc:  # raised in the caller's thread instead
            self._error = exc
        finally:
            try:
                self._source.close()  # in this thread: a generator closes where it runs
            except BaseException as exc:
                self._error = self._error or exc
            finally:
                with self._cond:
                    self._finished = True
                    self._cond.notify_all()
