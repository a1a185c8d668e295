"""The directory backend's per-sample decision: what to do with one sample file now.

``Decider.decide(name)`` looks at one sample without waiting (or waits for its writer up
to a given time), claims it when the reader shares the directory, loads it, and asks the
one sample-state rule (``hidden_state_reader.sample.states.judge``) what it is. The answer
is an ``Outcome`` (``read.backend``, where its kinds are listed); a claim the outcome does
not carry on is settled here (``claim_lifecycle``).

A snapshot reader looks at a small data file first and yields it without its lock when
it is a complete file of this project's writers, published by rename
(``Decider._look_published``, ``docs/format.md``); everything else, and every follower
or claiming reader, keeps to the lock protocol.

Nothing here counts, warns or moves files: that is the reader's business. The one thing
kept between calls is a hint, whether the last file looked at was ours (a directory of
another writer's files is read lock first, without a wasted read per file).
"""

from __future__ import annotations

import os
import time

from hidden_state_reader.errors import CorruptSampleError, SampleError
from hidden_state_reader.files.fileio import NotRegularFileError, open_regular_stat, open_sized
from hidden_state_reader.files.flockwait import CancelToken
from hidden_state_reader.files.locks import SharedLock, read_status
from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.lock_status import LockState
from hidden_state_reader.format.names import lock_path
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.probes import LOCK_ACQUIRE, probes
from hidden_state_reader.read.backend import Outcome, OutcomeKind, judged, rejected
from hidden_state_reader.read.claim_lifecycle import Ending, settle
from hidden_state_reader.read.claims import Claim, ClaimResult, ClaimStore
from hidden_state_reader.read.membership import Membership
from hidden_state_reader.read.ownership import Ownership
from hidden_state_reader.sample.load import MMAP_MIN_BYTES, load_fd, load_published
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import GRACE, SampleState, judge, observe

GROUP_BATCH_WINDOW = (0.00625, 0.25)
"""Seconds per member, and at most, that a follower's watch lets events gather in a group.

Every member reads every sample's events; a window growing with the group keeps the
whole group's reading of events per second the same however many members it has (16
members: 0.1 s), at the cost of that much latency before a member sees its own sample.
"""


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
        membership: The group as this follower sees it; with it, a sample another
            member owns (``read.ownership``) is left to that member until this one's
            turn comes (``DEFERRED``), and then looked at cheaply first (``_stand_in``).
        steal_after: Seconds before the first stand-in acts (``read.ownership``).
        published_unlocked: Yield a small complete file of this project's writers
            without taking its lock (``_look_published``); only without ``claims``.
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
        membership: Membership | None = None,
        steal_after: float = 2.0,
        published_unlocked: bool = False,
    ) -> None:
        self.root = root
        # os.path.join(root, name) for the plain names of a directory, as one concatenation.
        self._prefix = os.path.join(root, "")
        self.membership = membership
        self.ownership = (
            None
            if membership is None
            else Ownership(membership.members, membership.me, steal_after)
        )
        self._changes_seen = 0
        self.load = load
        self.claims = claims
        self.grace = grace
        self.claim_retry = claim_retry
        self.lock_type = lock_type
        self.published_unlocked = published_unlocked and claims is None
        # Off after a file of another writer (its lock comes first: one read, not two),
        # on again after a file of ours.
        self._expect_published = True

    def group_changed(self) -> bool:
        """Watch the neighbour member (reaping it if it died); True if the group changed.

        Cheap to call per sample: the membership probes and lists at most once per
        refresh period.
        """
        if self.membership is None or not self.membership.joined:
            return False
        self.membership.watch_neighbour()
        assert self.ownership is not None
        self.ownership.ring()  # rebuilt here when the members changed
        changed = self.membership.changes != self._changes_seen
        self._changes_seen = self.membership.changes
        return changed

    def event_batch_window(self) -> float:
        """Seconds this reader's watch may let events gather (``GROUP_BATCH_WINDOW``).

        Alone, every event is this reader's own: read each at once. In a group, most are
        about other members' samples: read them in batches.
        """
        size = 0 if self.membership is None else len(self.membership.members())
        per_member, most = GROUP_BATCH_WINDOW
        return 0.0 if size < 2 else min(most, per_member * size)

    def decide(self, name: str, wait: float = 0.0, cancel: CancelToken | None = None) -> Outcome:
        """Decide about one sample; wait at most ``wait`` seconds for its writer.

        Raises:
            WaitCancelledError: ``cancel`` was cancelled during a wait.
        """
        data_path = os.path.join(self.root, name) if name[:1] == "/" else self._prefix + name
        if self.ownership is not None and not self.ownership.owns(name):
            standing_in = self._stand_in(name, data_path)
            if standing_in is not None:
                return standing_in
        if self.published_unlocked and self._expect_published:
            published = self._look_published(name, data_path)
            if published is not None:
                return published
        try:
            lock = self._acquire(data_path, wait, cancel)
        except SampleError as exc:
            return rejected(name, SampleState.CORRUPT, exc)
        except OSError as exc:  # permissions, I/O errors: this sample only
            return rejected(name, SampleState.CORRUPT, _unreadable(data_path, exc))
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
                settle(claim, Ending.RETURNED)
                raise
        if outcome.kind is OutcomeKind.VANISHED:
            settle(claim, Ending.GONE)
        elif outcome.kind is OutcomeKind.RECHECK:
            settle(claim, Ending.RETURNED)
        return outcome

    def _acquire(
        self, data_path: str, wait: float, cancel: CancelToken | None
    ) -> SharedLock | None:
        """Take the shared lock, telling ``probes.LOCK_ACQUIRE`` how long it took."""
        observers = probes(LOCK_ACQUIRE)
        began = time.monotonic() if observers else 0.0
        lock = self.lock_type.acquire(data_path, timeout=wait, cancel=cancel)
        for callback in observers:
            callback(path=data_path, began=began, acquired=time.monotonic())
        return lock

    def _stand_in(self, name: str, data_path: str) -> Outcome | None:
        """Another member owns ``name``: wait for this one's turn, then look cheaply.

        None when this reader should go on to claim the sample itself: it is there,
        unclaimed (or claimed by a member that died) a whole turn after its data appeared.
        """
        ownership, membership, claims = self.ownership, self.membership, self.claims
        assert ownership is not None and membership is not None and claims is not None
        turn = ownership.turn(name)
        if turn > 0:
            return Outcome(OutcomeKind.DEFERRED, name, delay=turn)
        if not os.path.exists(data_path):
            if os.path.exists(lock_path(data_path)):  # still being written: owners first
                ownership.again_later(name)
                return Outcome(OutcomeKind.DEFERRED, name, delay=ownership.turn(name))
            ownership.forget(name)
            return Outcome(OutcomeKind.OWNED_ELSEWHERE, name, gone=True)
        ahead = ownership.ahead_of_me(name)
        dead = [m for m in ahead if not membership.alive(m)]
        if claims.exists(name) and not dead:
            ownership.forget(name)  # its claimer finishes it, or its owner takes it over
            return Outcome(OutcomeKind.OWNED_ELSEWHERE, name)
        if not dead and ownership.first_look_at_data(name):
            return Outcome(OutcomeKind.DEFERRED, name, delay=ownership.turn(name))
        for member in dead:
            membership.reap(member)  # the ranking moves on for every later sample too
        ownership.forget(name)
        return None

    def _look_published(self, name: str, data_path: str) -> Outcome | None:
        """A small complete file of this project's writers, ready without its lock.

        Our writers make a sample's name appear by renaming a complete file onto it
        (``files/publish.py``) and never write that file again, so once it is there and
        complete by the header rule it is final, whatever its lock says: the lock can
        only be held by its writer between the rename and the release, or by the writer
        of a new version, which replaces the file by another rename (``docs/format.md``,
        "Files published by rename"). Small files only: for them the lock costs as much
        as the read. Anything else found here (no data, a file without
        ``format_version``, one that fails to load, zero tokens) gives None: the lock
        protocol then decides, lock first and the data read again.
        """
        try:
            fd, size = open_sized(data_path)  # a non-regular file fails below: None
        except OSError:
            return None
        try:
            if size >= MMAP_MIN_BYTES:
                return None
            sample = load_published(fd, data_path, self.load, size)
        except (SampleError, OSError):
            return None
        finally:
            os.close(fd)
        if sample is None:
            self._expect_published = False
            return None
        if sample.num_tokens == 0:
            return None  # empty: rejected by the state rule, under the lock
        return Outcome(OutcomeKind.YIELD, name, sample, None, SampleState.READY)

    def _look(self, name: str, data_path: str, locked: bool, claim: Claim | None) -> Outcome:
        """Read the sample while its lock is held shared (or it has none)."""
        try:
            fd, st = open_regular_stat(data_path)
        except NotRegularFileError:
            error = CorruptSampleError(data_path, "not a regular file")
            return rejected(name, SampleState.CORRUPT, error, claim)
        except FileNotFoundError:
            return self._no_data(name, data_path, locked, claim)
        except OSError as exc:
            return rejected(name, SampleState.CORRUPT, _unreadable(data_path, exc), claim)
        sample: Sample | None = None
        problem: SampleError | None = None
        age = time.time() - st.st_mtime
        try:
            sample = load_fd(fd, data_path, self.load, st.st_size)
        except SampleError as exc:
            problem = exc
        except OSError as exc:
            problem = _unreadable(data_path, exc)
        finally:
            os.close(fd)
        if sample is not None and Meta.FORMAT in sample.metadata:
            self._expect_published = True
        obs = observe(
            LockState.FREE if locked else LockState.ABSENT,
            data_exists=True,
            data_age=age,
            problem=problem,
            num_tokens=None if sample is None else sample.num_tokens,
        )
        return judged(name, data_path, judge(obs, self.grace), sample, problem, claim)

    def _no_data(self, name: str, data_path: str, locked: bool, claim: Claim | None) -> Outcome:
        lock_file = lock_path(data_path)
        try:
            lock_age = time.time() - os.stat(lock_file).st_mtime
        except FileNotFoundError:
            lock_age = None
        if not locked or lock_age is None:
            return Outcome(OutcomeKind.VANISHED, name)  # consumed elsewhere, or removed
        status = read_status(lock_file)
        obs = observe(LockState.FREE, status, lock_age)
        return judged(name, data_path, judge(obs, self.grace), None, None, claim)


def _unreadable(path: str, exc: OSError) -> CorruptSampleError:
    return CorruptSampleError(path, f"cannot read: {exc}")
