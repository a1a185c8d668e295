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

from collections.abc import Callable, Generator, Iterator
from typing import Generic, TypeVar

from hidden_state_reader.errors import WaitCancelledError
from hidden_state_reader.stages import Stage, StageStoppedError

T = TypeVar("T")

Room = Callable[[], None]
"""``room()``: wait until the pass may read one more sample ahead (``WaitCancelledError``
when the read-ahead is closing)."""

_MAX_QUEUED = 1024  # items queued ahead of the caller, whatever they hold


class ReadAhead(Generic[T]):
    """A backend pass running in a thread, ``samples`` samples ahead at most.

    The thread, its queue, stopping it and carrying its exception are a
    ``hidden_state_reader.stages.Stage``; this class adds the budget of samples.

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
        self._stage: Stage[T] = Stage(
            lambda: source(self.room),
            capacity=_MAX_QUEUED,
            name=name,
            budget=max(1, samples),
            weight=lambda item: int(holds_sample(item)),
            interrupt=interrupt,
            start=False,
        )
        self._stage.start()  # the pass calls ``room``, which needs the stage

    def __iter__(self) -> Iterator[T]:
        """The pass's items, in order; the pass's exception, if it raised one."""
        return iter(self._stage)

    def room(self) -> None:
        """Wait until fewer than ``samples`` items holding a sample are queued (the pass).

        Raises:
            WaitCancelledError: The read-ahead is closing.
        """
        try:
            self._stage.room()
        except StageStoppedError:
            raise WaitCancelledError("read-ahead closed") from None

    def stop(self) -> None:
        """Ask the thread to stop reading ahead (safe from any thread; does not wait)."""
        self._stage.stop()

    def close(self) -> list[T]:
        """Stop the thread (after the store call it is in, if any); the items not taken."""
        return self._stage.close()
