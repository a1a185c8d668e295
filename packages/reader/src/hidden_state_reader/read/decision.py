"""What to do with one sample now: the reader's per-sample decision, as an ``Outcome``.

``Decider.decide(name)`` looks at one sample without waiting (or waits for its writer up
to a given time), claims it when the reader shares the directory, loads it, and asks the
one sample-state rule (``hidden_state_reader.sample.states.judge``) what it is. The answer is an
``Outcome`` whose ``kind`` says what the caller does next:

==================  ===========================================================
``YIELD``           hand ``sample`` to the caller (then settle ``claim``)
``PENDING``         a writer holds the lock: wait for its release
``RECHECK``         no writer holds a lock but the sample may still be coming (a
                    young lock without data, a lock-less file still growing): look
                    again in ``delay`` seconds, or sooner when the files change
``REJECT``          unusable: ``state`` says why, ``error`` names the file
``VANISHED``        consumed or removed meanwhile
``CLAIMED``         another reader of the group has it: look again in ``delay``
``DONE_ELSEWHERE``  another reader of the group consumed it
``TIMED_OUT``       (made by the caller) the writer still held the lock when
                    ``lock_timeout`` ran out
==================  ===========================================================

Nothing here keeps state between calls, counts, warns or moves files: that is the
reader's business.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass

from hidden_state_reader.errors import (
    CorruptSampleError,
    FailedSampleError,
    IncompleteSampleError,
    SampleError,
    StaleLockError,
)
from hidden_state_reader.format.fileio import NotRegularFileError, open_regular
from hidden_state_reader.format.flockwait import CancelToken
from hidden_state_reader.format.lockfile import LockState, SharedLock, read_status
from hidden_state_reader.format.names import lock_path
from hidden_state_reader.read.claims import Claim, ClaimResult, ClaimStore
from hidden_state_reader.sample.load import LoadOptions, load_fd
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import GRACE, Observation, SampleState, Verdict, judge


class OutcomeKind(enum.Enum):
    """What the caller does next with a sample (see the module docstring)."""

    YIELD = "yield"
    PENDING = "pending"
    RECHECK = "recheck"
    REJECT = "reject"
    VANISHED = "vanished"
    CLAIMED = "claimed"
    DONE_ELSEWHERE = "done_elsewhere"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class Outcome:
    """The decision about one sample.

    Attributes:
        kind: What to do next.
        name: The sample name.
        sample: The loaded sample (``YIELD``).
        claim: This reader's claim, to settle after use or rejection (``YIELD``,
            ``REJECT``; None without claims).
        state: The sample state (``REJECT``; also ``YIELD`` and ``PENDING``).
        error: The typed error naming the file (``REJECT``).
        delay: Seconds until the next look (``RECHECK``, ``CLAIMED``).
    """

    kind: OutcomeKind
    name: str
    sample: Sample | None = None
    claim: Claim | None = None
    state: SampleState | None = None
    error: SampleError | None = None
    delay: float = 0.0


_ERRORS: dict[SampleState, type[SampleError]] = {
    SampleState.FAILED: FailedSampleError,
    SampleState.STALE: StaleLockError,
    SampleState.INCOMPLETE: IncompleteSampleError,
}


class Decider:
    """Decides about samples of one storage directory.

    Args:
        root: The storage directory.
        load: How samples are turned into tensors.
        claims: The consumer group's claims, when readers share the directory.
        grace: See ``hidden_state_reader.sample.states.GRACE``.
        claim_retry: Seconds until a sample another reader claimed is looked at again
            (if that reader dies, its claim must be taken over).
        lock_type: The class whose ``acquire`` takes a reader's shared lock.
    """

    def __init__(
        self,
        root: str,
        load: LoadOptions,
        *,
        claims: ClaimStore | None = None,
        grace: float = GRACE,
        claim_retry: float = 30.0,
        lock_type: type[SharedLock] = SharedLock,
    ) -> None:
        self.root = root
        self.load = load
        self.claims = claims
        self.grace = grace
        self.claim_retry = claim_retry
        self.lock_type = lock_type

    def decide(self, name: str, wait: float = 0.0, cancel: CancelToken | None = None) -> Outcome:
        """Decide about one sample; wait at most ``wait`` seconds for its writer.

        Raises:
            WaitCancelledError: ``cancel`` was cancelled during a wait.
        """
        data_path = os.path.join(self.root, name)
        try:
            lock = self.lock_type.acquire(data_path, timeout=wait, cancel=cancel)
        except SampleError as exc:
            return self._reject(name, SampleState.CORRUPT, exc, None)
        except OSError as exc:  # permissions, I/O errors: this sample only
            return self._reject(name, SampleState.CORRUPT, _unreadable(data_path, exc), None)
        if lock is None:
            return Outcome(OutcomeKind.PENDING, name, state=SampleState.PENDING)
        with lock:
            claim: Claim | None = None
            if self.claims is not None:
                result = self.claims.try_claim(name)
                if result is ClaimResult.HELD:
                    return Outcome(OutcomeKind.CLAIMED, name, delay=self.claim_retry)
                if result is ClaimResult.DONE:
                    return Outcome(OutcomeKind.DONE_ELSEWHERE, name)
                assert isinstance(result, Claim)
                claim = result
            try:
                outcome = self._look(name, data_path, lock.existed, claim)
            except BaseException:
                if claim is not None:
                    claim.abandon()
                raise
        if outcome.kind is OutcomeKind.VANISHED and claim is not None:
            claim.remove()
        elif outcome.kind is OutcomeKind.RECHECK and claim is not None:
            claim.abandon()
        return outcome

    def _look(self, name: str, data_path: str, locked: bool, claim: Claim | None) -> Outcome:
        """Read the sample while its lock is held shared (or it has none)."""
        try:
            fd = open_regular(data_path)
        except NotRegularFileError:
            error = CorruptSampleError(data_path, "not a regular file")
            return self._reject(name, SampleState.CORRUPT, error, claim)
        except FileNotFoundError:
            return self._no_data(name, data_path, locked, claim)
        except OSError as exc:
            return self._reject(name, SampleState.CORRUPT, _unreadable(data_path, exc), claim)
        sample: Sample | None = None
        problem: SampleError | None = None
        age: float | None = None
        try:
            age = time.time() - os.fstat(fd).st_mtime
            sample = load_fd(fd, data_path, self.load)
        except SampleError as exc:
            problem = exc
        except OSError as exc:
            problem = _unreadable(data_path, exc)
        finally:
            os.close(fd)
        obs = Observation(
            LockState.FREE if locked else LockState.ABSENT,
            data_exists=True,
            data_age=age,
            problem=problem,
            num_tokens=None if sample is None else sample.num_tokens,
        )
        return self._apply(name, data_path, judge(obs, self.grace), sample, claim, problem)

    def _no_data(self, name: str, data_path: str, locked: bool, claim: Claim | None) -> Outcome:
        lock_file = lock_path(data_path)
        try:
            lock_age = time.time() - os.stat(lock_file).st_mtime
        except FileNotFoundError:
            lock_age = None
        if not locked or lock_age is None:
            return Outcome(OutcomeKind.VANISHED, name)  # consumed elsewhere, or removed
        obs = Observation(LockState.FREE, read_status(lock_file), lock_age)
        return self._apply(name, data_path, judge(obs, self.grace), None, claim, None)

    def _apply(
        self,
        name: str,
        data_path: str,
        verdict: Verdict,
        sample: Sample | None,
        claim: Claim | None,
        problem: SampleError | None,
    ) -> Outcome:
        if verdict.state is SampleState.READY:
            return Outcome(OutcomeKind.YIELD, name, sample, claim, SampleState.READY)
        if verdict.state is SampleState.PENDING:
            return Outcome(OutcomeKind.RECHECK, name, delay=verdict.recheck_in or 0.0)
        if problem is None or verdict.state is SampleState.EMPTY:
            problem = _ERRORS.get(verdict.state, CorruptSampleError)(data_path, verdict.reason)
        return self._reject(name, verdict.state, problem, claim)

    @staticmethod
    def _reject(name: str, state: SampleState, error: SampleError, claim: Claim | None) -> Outcome:
        return Outcome(OutcomeKind.REJECT, name, claim=claim, state=state, error=error)


def _unreadable(path: str, exc: OSError) -> CorruptSampleError:
    return CorruptSampleError(path, f"cannot read: {exc}")


__all__ = ["Decider", "Outcome", "OutcomeKind"]
