"""What a reader reads from: the ``Backend`` protocol and the ``Outcome`` it hands out.

``HiddenStateReader`` runs one pipeline over every backend, the four stages of reading:

1. **discover**, 2. **wait** and 3. **decide** are the backend's: ``outcomes()`` finds
   sample names, waits for those still being written (many at once, none holding up
   another) and decides about each, claiming it first when readers share the source.
   It hands out one ``Outcome`` per decision, in completion order.
4. **consume** is the reader's: it applies the one error policy (``read.policy``: count,
   warn or raise, ``set_aside`` a bad sample), yields each good sample and then tells the
   backend it was ``consumed``.

Two backends implement the protocol: ``read.directory.DirectoryBackend`` (sample files in
a shared directory) and ``store.backend.StoreBackend`` (a Mooncake Store). This module
imports neither; ``reader.open_backend`` picks one for a path.

The kinds of ``Outcome`` are listed at ``OutcomeKind``.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Sequence
from typing import NamedTuple, Protocol

from hidden_state_reader.errors import (
    CorruptSampleError,
    FailedSampleError,
    IncompleteSampleError,
    SampleError,
    StaleLockError,
)
from hidden_state_reader.read.claim_lifecycle import HeldClaim
from hidden_state_reader.read.counters import WatchCounters
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import SampleState, Verdict


class OutcomeKind(enum.Enum):
    """What the caller does next with a sample.

    ==================  ===========================================================
    ``YIELD``           hand ``sample`` to the caller (then settle ``claim``)
    ``PENDING``         a writer holds the lock: wait for its release
    ``RECHECK``         no writer holds a lock but the sample may still be coming (a
                        young lock without data, a lock-less file still growing): look
                        again in ``delay`` seconds, or sooner when the files change
    ``REJECT``          unusable: ``state`` says why, ``error`` names the sample
    ``VANISHED``        consumed or removed meanwhile
    ``CLAIMED``         another reader of the group has it: look again in ``delay``
    ``DONE_ELSEWHERE``  another reader of the group consumed it
    ``TIMED_OUT``       its writer did not finish within ``lock_timeout``; ``error``
                        says so
    ``DEFERRED``        another member of the group owns it: look again in ``delay``,
                        when this reader's turn comes (``read.ownership``)
    ``OWNED_ELSEWHERE`` another member of the group owns it and has taken it (``gone``:
                        its files are gone too)
    ==================  ===========================================================

    ``PENDING``, ``RECHECK`` and ``DEFERRED`` stay inside a backend (they are waited for);
    the reader sees every other kind.
    """

    YIELD = "yield"
    PENDING = "pending"
    RECHECK = "recheck"
    REJECT = "reject"
    VANISHED = "vanished"
    CLAIMED = "claimed"
    DONE_ELSEWHERE = "done_elsewhere"
    TIMED_OUT = "timed_out"
    DEFERRED = "deferred"
    OWNED_ELSEWHERE = "owned_elsewhere"


class Outcome(NamedTuple):
    """The decision about one sample (immutable; a named tuple: one is made per sample).

    Attributes:
        kind: What to do next.
        name: The sample name.
        sample: The loaded sample (``YIELD``).
        claim: This reader's claim, to settle after use or rejection (``YIELD``,
            ``REJECT``; None without claims).
        state: The sample state (``REJECT``; also ``YIELD`` and ``PENDING``).
        error: The typed error naming the sample (``REJECT``, ``TIMED_OUT``).
        delay: Seconds until the next look (``RECHECK``, ``CLAIMED``, ``DEFERRED``).
        gone: ``OWNED_ELSEWHERE``: the sample's files are gone as well.
    """

    kind: OutcomeKind
    name: str
    sample: Sample | None = None
    claim: HeldClaim | None = None
    state: SampleState | None = None
    error: SampleError | None = None
    delay: float = 0.0
    gone: bool = False


_ERRORS: dict[SampleState, type[SampleError]] = {
    SampleState.FAILED: FailedSampleError,
    SampleState.STALE: StaleLockError,
    SampleState.INCOMPLETE: IncompleteSampleError,
}


def judged(
    name: str,
    where: str,
    verdict: Verdict,
    sample: Sample | None,
    problem: SampleError | None,
    claim: HeldClaim | None = None,
) -> Outcome:
    """The outcome of a sample judged by the one state rule (``sample.states.judge``).

    Args:
        name: The sample name.
        where: The sample's path or address, for the error.
        verdict: What ``judge`` said.
        sample: The loaded sample, if loading worked.
        problem: What loading found wrong, if anything.
        claim: This reader's claim on it (carried by ``YIELD`` and ``REJECT`` only).
    """
    if verdict.state is SampleState.READY:
        return Outcome(OutcomeKind.YIELD, name, sample, claim, SampleState.READY)
    if verdict.state is SampleState.PENDING:
        return Outcome(OutcomeKind.RECHECK, name, delay=verdict.recheck_in or 0.0)
    if problem is None or verdict.state is SampleState.EMPTY:
        problem = _ERRORS.get(verdict.state, CorruptSampleError)(where, verdict.reason)
    return rejected(name, verdict.state, problem, claim)


def rejected(
    name: str, state: SampleState, error: SampleError, claim: HeldClaim | None = None
) -> Outcome:
    """A ``REJECT`` outcome: ``state`` says why, ``error`` names the sample."""
    return Outcome(OutcomeKind.REJECT, name, claim=claim, state=state, error=error)


class Receipt(Protocol):
    """What it takes to record a sample as consumed from another process (picklable).

    A DataLoader worker reads a sample and holds its claim; the training process settles
    the receipt once its loop has trained the sample (``training.acknowledgement``), and
    the worker then lets go of the claim (``Backend.released``).
    """

    def settle(self) -> None:
        """Keep, delete or move the sample and settle its claim, as ``consumed`` would."""
        ...


class Backend(Protocol):
    """Where a reader's samples come from (see the module docstring).

    Attributes:
        where: The source as the user named it (directory or store URL), for messages.
    """

    where: str

    def outcomes(self, names: Sequence[str] | None = None) -> Generator[Outcome, None, None]:
        """Discover, wait for and decide about samples; one outcome per decision.

        Each call starts a new pass over the source: over exactly ``names`` when given
        (else the options' ``names``, else what the source holds, or follows). Ends when
        the pass is done (or, following, idle for ``idle_timeout``), or on ``close``.
        """
        ...

    def pending(self) -> list[str]:
        """Names of samples still being written at the last look."""
        ...

    def set_aside(self, name: str, reason: str) -> bool:
        """Move a rejected sample out of the way, if this reader may; True if it did."""
        ...

    def forget(self, name: str) -> None:
        """A sample vanished: stop tracking it."""
        ...

    def consumed(self, name: str, claim: HeldClaim | None) -> None:
        """The caller has taken a yielded sample: keep, delete or move it; settle its claim.

        Must be repeatable: it is called again when a Ctrl-C cut the first call short.
        """
        ...

    def receipt(self, name: str, claim: HeldClaim | None) -> Receipt | None:
        """A receipt that records the sample as consumed from any process, if there is one."""
        ...

    def released(self, name: str, claim: HeldClaim | None) -> None:
        """The sample's receipt was settled elsewhere: let go of its claim, stop tracking it."""
        ...

    def watch_counters(self) -> WatchCounters | None:
        """What a directory watch did while following (None: no such watch)."""
        ...

    def close(self) -> None:
        """Stop: interrupt a wait in progress (safe from another thread, or twice)."""
        ...
