"""The one sample-state rule: what a sample is, given what was observed about it.

Every part of the package that has to say what a sample is — the reader deciding whether
to yield, wait or skip, ``len(HiddenStateDataset)``, and the ``ls``, ``stats``,
``verify``, ``clean`` and ``inspect`` commands — gathers an ``Observation`` of the
sample (its lock, the status the writer left in it, whether and how old the data file
is, what reading it found) and asks ``judge`` for the verdict. There is one grace period,
``GRACE``: how long a released lock without data, or a lock-less file that fails to
parse, may be young and still count as work in progress. It is not needed where the
writer is known to be gone (its lock records a process of this host that no longer
runs: ``files.identity.check_writer``): such a lock is stale at once.

The states are listed in ``SampleState``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hidden_state_reader.errors import IncompleteSampleError, SampleError
from hidden_state_reader.files.identity import WriterCheck, WriterFate, check_writer
from hidden_state_reader.format.lock_status import LockState, LockStatus

GRACE = 30.0
"""Seconds a released lock without data, a lock-less truncated file or a temporary file
may be untouched and still count as work in progress (``pending``) rather than a
leftover. The reader (``orphan_grace``) and every command use this same default."""


class SampleState(str, enum.Enum):
    """The state of one sample (or temporary file). The value is the printable name.

    ``ready``
        A complete, valid sample with at least one token whose writer is done (or that
        never had a lock).
    ``pending``
        Being written: the lock is held, or the files changed less than the grace period ago
        and no lock says otherwise (vLLM's connector creates its lock file a moment before
        it locks it; a lock-less writer may still be appending).
    ``failed``
        The writer gave up and said why in the lock file; there is no data file.
    ``stale``
        A released lock whose data file never appeared, whose writer is known to be gone
        or that is older than the grace period.
    ``incomplete``
        The data file is shorter than its header promises and no writer is at work.
    ``corrupt``
        The data file is not a valid sample, or it cannot be read at all.
    ``empty``
        A valid file with zero tokens: nothing to train on, readers skip it.
    ``orphan_temp``
        A temporary file no writer owns any more (see ``health.check_temp``).
    """

    READY = "ready"
    PENDING = "pending"
    FAILED = "failed"
    STALE = "stale"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    EMPTY = "empty"
    ORPHAN_TEMP = "orphan_temp"

    @property
    def is_problem(self) -> bool:
        """Whether this state needs attention (everything but ``ready`` and ``pending``)."""
        return self not in (SampleState.READY, SampleState.PENDING)

    @property
    def usable(self) -> bool:
        """Whether a reader will yield this sample (now, or once its writer is done)."""
        return self in (SampleState.READY, SampleState.PENDING)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Observation:
    """What was seen of one sample, in the order it must be looked at.

    Attributes:
        lock: The lock file, probed (or held shared by the reader: ``FREE``).
        status: The status the writer left in the lock file (None without a lock).
        lock_age: Seconds since the lock file was modified (None without one).
        data_exists: Whether the data file exists.
        data_age: Seconds since the data file was modified (None without one).
        problem: What reading the data file found wrong (None: it is valid).
        num_tokens: Tokens of a valid data file.
        writer: What could be found out about the process that wrote the lock's status
            (``files.identity.check_writer``); None when it was not looked at.
    """

    lock: LockState
    status: LockStatus | None = None
    lock_age: float | None = None
    data_exists: bool = False
    data_age: float | None = None
    problem: SampleError | None = None
    num_tokens: int | None = None
    writer: WriterCheck | None = None


def observe(
    lock: LockState,
    status: LockStatus | None = None,
    lock_age: float | None = None,
    *,
    data_exists: bool = False,
    data_age: float | None = None,
    problem: SampleError | None = None,
    num_tokens: int | None = None,
) -> Observation:
    """The one builder of an ``Observation``: the readers' and the commands' alike.

    It asks whether the lock's writer still runs (a ``/proc`` look-up,
    ``check_writer``) exactly where the rule needs the answer: a free lock without data
    whose status is not ``failed`` (a failed status says what happened itself).
    """
    failed = status is not None and status.failed
    asks = not data_exists and lock is LockState.FREE and not failed
    return Observation(
        lock,
        status,
        lock_age,
        data_exists,
        data_age,
        problem,
        num_tokens,
        check_writer(status) if asks else None,
    )


@dataclass(frozen=True)
class Verdict:
    """A sample's state and why, in a few words.

    Attributes:
        state: The state.
        reason: Why (empty for a plain ``ready`` sample).
        recheck_in: For a ``pending`` sample whose lock is free: seconds until the grace
            period runs out and the verdict may change (None otherwise).
    """

    state: SampleState
    reason: str = ""
    recheck_in: float | None = None


def judge(obs: Observation, grace: float = GRACE) -> Verdict:
    """The state of a sample, from an observation of it.

    The lock must have been looked at before the data file: a writer of this format
    publishes before it releases its lock, so it can then never be mistaken for a dead
    one.

    Args:
        obs: What was seen.
        grace: See ``GRACE``.

    Returns:
        The verdict.

    Raises:
        FileNotFoundError: Neither a lock nor a data file exists (consumed or removed).
    """
    if obs.lock is LockState.HELD:
        return Verdict(SampleState.PENDING, f"writer holds the lock{_writer(obs.status)}")
    if not obs.data_exists:
        return _without_data(obs, grace)
    if isinstance(obs.problem, IncompleteSampleError):
        age = obs.data_age
        if obs.lock is LockState.ABSENT and age is not None and age < grace:
            return Verdict(
                SampleState.PENDING,
                f"no lock and modified {age:.1f}s ago; a writer may still be appending "
                f"({obs.problem.reason})",
                recheck_in=grace - age,
            )
        return Verdict(SampleState.INCOMPLETE, obs.problem.reason)
    if obs.problem is not None:
        return Verdict(SampleState.CORRUPT, obs.problem.reason)
    if obs.num_tokens == 0:
        return Verdict(SampleState.EMPTY, "zero tokens: readers skip it")
    return Verdict(SampleState.READY)


def _without_data(obs: Observation, grace: float) -> Verdict:
    if obs.lock is LockState.ABSENT:
        raise FileNotFoundError("neither the data file nor its lock exists")
    if obs.status is not None and obs.status.failed:
        return Verdict(SampleState.FAILED, f"writer reported failure: {obs.status.reason}")
    writer = obs.writer
    if writer is not None and writer.fate is WriterFate.GONE:
        return Verdict(
            SampleState.STALE, f"lock released, the data file never appeared and {writer.why}"
        )
    # Whether the writer lives cannot be told here: the grace period decides.
    case = f"; {writer.why}, so the {grace:g}s grace period applies" if writer else ""
    age = obs.lock_age
    if age is not None and age < grace:
        return Verdict(
            SampleState.PENDING,
            f"lock free for now and no data yet; lock created {age:.1f}s ago{case}",
            recheck_in=grace - age,
        )
    unchanged = f" (unchanged for {age:.0f}s)" if age is not None else ""
    return Verdict(
        SampleState.STALE, f"lock released but the data file never appeared{unchanged}{case}"
    )


def _writer(status: LockStatus | None) -> str:
    if status is None or status.state is None:
        return ""
    pid, host = status.detail.get("pid"), status.detail.get("host")
    if pid is None:
        return ""
    return f" (pid {pid}" + (f" on {host})" if host else ")")


__all__ = ["GRACE", "Observation", "SampleState", "Verdict", "judge"]
