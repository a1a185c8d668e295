"""The resume contract every resumable dataset and loader of the reader must keep.

Like torchdata's ``run_test_save_load_state``: read ``stop_after`` units (batches or
samples) of a fresh object, take ``state_dict()`` (through JSON, as a checkpoint stores
it), build another fresh object (possibly set up differently: another worker count or
batch size), ``load_state_dict()`` it, and read on. What was read before the
interruption plus what the resumed object reads must be exactly the uninterrupted run:
nothing lost, nothing twice, and (for ordered sources) the same order; the epochs after
it must match the uninterrupted run's too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, Protocol


class Resumable(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Any) -> None: ...


Units = Callable[[Any], Iterable[list[str]]]
"""``units(obj)``: one pass over ``obj``, as lists of sample names (one per batch)."""


def _flat(units: Iterable[list[str]]) -> list[str]:
    return [name for unit in units for name in unit]


def check_resume_contract(
    make: Callable[[], Any],
    units: Units,
    *,
    stop_after: int,
    make_resumed: Callable[[], Any] | None = None,
    reference: Callable[[], Any] | None = None,
    later_epochs: int = 1,
    ordered: bool = True,
    through_json: bool = True,
) -> tuple[list[str], dict[str, Any]]:
    """Check the contract; returns what was read before the interruption, and the state.

    Args:
        make: A fresh object to interrupt.
        units: One pass over an object (see ``Units``).
        stop_after: Units read before the state is taken (must be inside the first pass).
        make_resumed: The fresh object that resumes (default: ``make``).
        reference: The object of the uninterrupted run (default: ``make``).
        later_epochs: Passes after the interrupted one to compare too.
        ordered: Compare in order (static order); otherwise as multisets (a followed
            directory comes in completion order).
        through_json: Round-trip the state through JSON.
    """
    ref = (reference or make)()
    expected = [_flat(units(ref)) for _ in range(1 + later_epochs)]

    first = make()
    passing: Iterator[list[str]] = iter(units(first))
    before = _flat(islice(passing, stop_after))
    state = first.state_dict()
    if through_json:
        state = json.loads(json.dumps(state))
    close = getattr(passing, "close", None)
    if close is not None:
        close()

    resumed = (make_resumed or make)()
    resumed.load_state_dict(state)
    got = [before + _flat(units(resumed))]
    got += [_flat(units(resumed)) for _ in range(later_epochs)]
    for epoch, (seen, want) in enumerate(zip(got, expected, strict=True)):
        if ordered:
            assert seen == want, f"pass {epoch}: {seen} != {want}"
        else:
            assert Counter(seen) == Counter(want), f"pass {epoch}: {sorted(seen)} != {sorted(want)}"
    return before, state
