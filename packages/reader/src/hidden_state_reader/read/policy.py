"""The reader's error policy: what it does with each outcome that is not "wait".

``ErrorPolicy.apply`` turns an ``Outcome`` of any backend (``read.backend``) into the
reader's side effects: counters in ``ReaderStats``, one warning (or a raised
``SampleError``) per bad sample as ``on_error`` says, a bad sample set aside
(``Backend.set_aside``: quarantine, where the reader owns the files) and its claim
settled. It returns the sample to yield, if any; consuming a yielded sample stays with
``HiddenStateReader``.
"""

from __future__ import annotations

import logging

from hidden_state_reader.errors import SampleError
from hidden_state_reader.options import OnError
from hidden_state_reader.read.backend import Backend, Outcome, OutcomeKind
from hidden_state_reader.read.claim_lifecycle import Ending, settle
from hidden_state_reader.read.counters import ReaderStats
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import SampleState

# The reader's messages keep the reader's logger name, wherever the code lives.
log = logging.getLogger("hidden_state_reader.reader")

_COUNTERS = {
    SampleState.INCOMPLETE: "incomplete",
    SampleState.FAILED: "failed",
    SampleState.STALE: "stale_locks",
    SampleState.EMPTY: "empty",
}


class ErrorPolicy:
    """Applies a reader's error policy to the outcomes of one iteration.

    Args:
        backend: Where the outcomes come from (it sets bad samples aside).
        stats: The reader's counters.
        on_error: ``"skip"`` (warn) or ``"raise"``.
        follow: Whether the reader follows its source (a timed-out sample may still
            come later).
    """

    def __init__(
        self, backend: Backend, stats: ReaderStats, *, on_error: OnError, follow: bool
    ) -> None:
        self.backend = backend
        self.stats = stats
        self.on_error = on_error
        self.follow = follow

    def apply(self, outcome: Outcome) -> Sample | None:
        """Count an outcome, warn or raise; the sample to yield, if any."""
        kind, stats = outcome.kind, self.stats
        if kind is OutcomeKind.YIELD:
            sample = outcome.sample
            assert sample is not None
            claim = outcome.claim
            if claim is not None and claim.reclaimed:
                stats.reclaimed += 1
                log.info("took over %s from a reader that is gone", outcome.name)
            stats.yielded += 1
            stats.bytes += sample.nbytes
            stats.tokens += sample.num_tokens
            return sample
        name = outcome.name
        if kind is OutcomeKind.REJECT:
            assert outcome.error is not None and outcome.state is not None
            self._reject(outcome, outcome.error, outcome.state)
        elif kind is OutcomeKind.VANISHED:
            stats.vanished += 1
            self.backend.forget(name)
        elif kind is OutcomeKind.CLAIMED:
            stats.claimed_elsewhere += 1
        elif kind is OutcomeKind.DONE_ELSEWHERE:
            stats.done_elsewhere += 1
        elif kind is OutcomeKind.OWNED_ELSEWHERE:
            stats.owned_elsewhere += 1
            if outcome.gone:
                self.backend.forget(name)
        elif kind is OutcomeKind.TIMED_OUT:
            assert outcome.error is not None
            self._timed_out(outcome.error)
        return None

    def _timed_out(self, error: SampleError) -> None:
        self.stats.lock_timeouts += 1
        if self.on_error == "raise":
            raise error
        log.warning("%s; %s", error, "yielded if it finishes later" if self.follow else "skipped")

    def _reject(self, outcome: Outcome, error: SampleError, state: SampleState) -> None:
        """Count, report and set aside a bad sample; the group is done with it."""
        counter = _COUNTERS.get(state, "corrupt")
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if self.backend.set_aside(outcome.name, str(error)):
            self.stats.quarantined += 1
        settle(outcome.claim, Ending.CONSUMED)
        if self.on_error == "raise":
            raise error
        log.warning("skipping %s", error)
