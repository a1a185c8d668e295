"""What a plain ``for sample in reader`` loop holds, and when it is consumed or given back.

The rule (docs/reader.md, "What does a crash lose?"): the sample the loop holds is
recorded as consumed (``on_consumed``, its claim settled) when the loop asks for the
next one, which proves the loop's body finished with it, or when the user calls
``commit()``. A loop that stops without asking (``break``, an exception in its body, its
iterator closed or collected, the reader's ``with`` block left) gives it back: not
deleted, not moved, its claim released to the group.

Python runs nothing after a generator's ``yield`` on ``break``, and an exception in the
loop's body never enters the generator: both only close the loop's iterator, which
throws ``GeneratorExit`` at the ``yield``. So ``Holding.deliver`` records the sample
after its ``yield`` returns normally and gives it back on any exception there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator

from hidden_state_reader.read.backend import Outcome
from hidden_state_reader.read.claim_lifecycle import Ending, settle
from hidden_state_reader.sample.sample import Sample


class Holding:
    """The samples a reader's plain loops hold now (one per loop; normally one).

    Args:
        commit: Records one outcome as consumed (the reader's ``_commit``).
    """

    def __init__(self, commit: Callable[[Outcome], None]) -> None:
        self._commit = commit
        self._held: list[Outcome] = []
        self._lock = threading.Lock()

    def deliver(self, outcome: Outcome, sample: Sample) -> Generator[Sample, None, None]:
        """Yield ``sample``: recorded when the loop comes back, given back if it never does."""
        with self._lock:
            self._held.append(outcome)
        try:
            yield sample
        except BaseException:
            if self._release(outcome):
                settle(outcome.claim, Ending.RETURNED)
            raise
        if self._release(outcome):
            self._commit(outcome)

    def commit(self) -> None:
        """Record every held sample as consumed now (a ``break`` after it keeps nothing)."""
        for outcome in self._release_all():
            self._commit(outcome)

    def give_back(self) -> None:
        """Give every held sample back (the reader's ``with`` block ends)."""
        for outcome in self._release_all():
            settle(outcome.claim, Ending.RETURNED)

    def _release(self, outcome: Outcome) -> bool:
        """Stop holding ``outcome``; False if ``commit`` or ``give_back`` already did."""
        with self._lock:
            for i, held in enumerate(self._held):
                if held is outcome:
                    del self._held[i]
                    return True
            return False

    def _release_all(self) -> list[Outcome]:
        with self._lock:
            held, self._held = self._held, []
            return held
