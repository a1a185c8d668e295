"""What a reader does with each decision that is not "wait": count, report, set aside.

``OutcomeHandler.apply`` turns an ``Outcome`` of ``decision`` into the reader's side
effects: counters in ``ReaderStats``, one warning (or a raised ``SampleError``) per bad
sample as ``on_error`` says, quarantine of a bad sample when the reader owns the files,
and the settling of its claim. It returns the sample to yield, if any; consuming a
yielded sample stays with ``HiddenStateReader``.
"""

from __future__ import annotations

import logging
import os

from hidden_state_reader.errors import LockTimeoutError, SampleError
from hidden_state_reader.options import OnError
from hidden_state_reader.read.claims import Claim
from hidden_state_reader.read.decision import Outcome, OutcomeKind
from hidden_state_reader.read.disposal import quarantine
from hidden_state_reader.read.sources import FollowSource, SnapshotSource
from hidden_state_reader.read.stats import ReaderStats
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


class OutcomeHandler:
    """Applies a reader's error policy to the outcomes of one iteration.

    Args:
        root: The storage directory.
        on_error: ``"skip"`` (warn) or ``"raise"``.
        owns_files: Bad samples may be moved to the quarantine folder.
        lock_timeout: The reader's lock timeout, for messages.
        follow: Whether the reader follows the directory (a timed-out sample may still
            come later).
    """

    def __init__(
        self, root: str, *, on_error: OnError, owns_files: bool, lock_timeout: float | None,
        follow: bool,
    ) -> None:  # fmt: skip
        self.root = root
        self.on_error = on_error
        self.owns_files = owns_files
        self.lock_timeout = lock_timeout
        self.follow = follow

    def apply(
        self, outcome: Outcome, source: SnapshotSource | FollowSource, stats: ReaderStats
    ) -> Sample | None:
        """Count an outcome, warn or raise; the sample to yield, if any."""
        kind, name = outcome.kind, outcome.name
        if kind is OutcomeKind.YIELD:
            sample = outcome.sample
            assert sample is not None
            if outcome.claim is not None and outcome.claim.reclaimed:
                stats.reclaimed += 1
                log.info("took over %s from a reader that is gone", name)
            stats.yielded += 1
            stats.bytes += sample.nbytes
            stats.tokens += sample.num_tokens
            return sample
        if kind is OutcomeKind.REJECT:
            assert outcome.error is not None and outcome.state is not None
            self._reject(name, outcome.error, outcome.state, outcome.claim, stats)
        elif kind is OutcomeKind.VANISHED:
            stats.vanished += 1
            source.forget(name)
        elif kind is OutcomeKind.CLAIMED:
            stats.claimed_elsewhere += 1
        elif kind is OutcomeKind.DONE_ELSEWHERE:
            stats.done_elsewhere += 1
        elif kind is OutcomeKind.TIMED_OUT:
            self._timed_out(name, stats)
        return None

    def _timed_out(self, name: str, stats: ReaderStats) -> None:
        stats.lock_timeouts += 1
        data_path = os.path.join(self.root, name)
        if self.on_error == "raise":
            raise LockTimeoutError(data_path, f"still locked after {self.lock_timeout}s")
        log.warning(
            "%s: writer still holds the lock after %ss; %s",
            data_path,
            self.lock_timeout,
            "yielded if it finishes later" if self.follow else "skipped",
        )

    def _reject(
        self,
        name: str,
        exc: SampleError,
        state: SampleState,
        claim: Claim | None,
        stats: ReaderStats,
    ) -> None:
        """Count, report and (when the reader owns the files) set aside a bad sample."""
        counter = _COUNTERS.get(state, "corrupt")
        setattr(stats, counter, getattr(stats, counter) + 1)
        if self.owns_files:
            try:
                if quarantine(self.root, name, str(exc)) is not None:
                    stats.quarantined += 1
            except OSError as move_exc:
                log.warning("cannot quarantine %s: %s", name, move_exc)
        if claim is not None:
            claim.done()
        if self.on_error == "raise":
            raise exc
        log.warning("skipping %s", exc)
