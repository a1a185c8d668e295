"""The directory backend: sample files in a (shared) storage directory.

``DirectoryBackend`` composes the stages of ``read/`` for one directory: ``sources``
discovers names (a snapshot, or following the directory), ``stream`` waits for many
writers at once and hands out decisions in completion order, ``decision`` decides about
one sample (claiming it in ``claims`` when readers share the directory), ``disposal``
keeps, deletes or moves a consumed sample and quarantines a rejected one. ``access``
checks at construction that the directory can be written where the options need it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Sequence
from typing import NamedTuple

from hidden_state_reader.files.flockwait import CancelToken, install_wake_handler
from hidden_state_reader.files.listing import describe_empty
from hidden_state_reader.files.locks import SharedLock
from hidden_state_reader.format.names import lock_path
from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.read.access import check_modes
from hidden_state_reader.read.backend import Outcome, OutcomeKind
from hidden_state_reader.read.claim_lifecycle import Ending, HeldClaim, settle
from hidden_state_reader.read.claims import Claim, ClaimStore, settle_claim_file
from hidden_state_reader.read.consumed_keys import drops_copy, record_consumed, sample_key
from hidden_state_reader.read.counters import WatchCounters
from hidden_state_reader.read.decision import Decider
from hidden_state_reader.read.disposal import dispose, quarantine
from hidden_state_reader.read.membership import Membership
from hidden_state_reader.read.sources import FollowSource, SnapshotSource
from hidden_state_reader.read.stream import CompletionStream

# The reader's messages keep the reader's logger name, wherever the code lives.
log = logging.getLogger("hidden_state_reader.reader")


class DirectoryBackend:
    """Samples of one storage directory (the ``read.backend.Backend`` protocol).

    Args:
        root: The storage directory.
        options: The reader's options.
        cancel: Cancelled by the reader's ``close``; interrupts a wait in progress.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        DirectoryNotWritableError: ``claim=True``, ``on_consumed="delete"`` or ``"move"``
            on a directory (or done folder) this process cannot write.
    """

    def __init__(self, root: str, options: ReaderOptions, cancel: CancelToken) -> None:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"hidden-state directory does not exist: {root}")
        self.where = self.root = root
        self.options = options
        self.done_dir = os.fspath(options.done_dir or os.path.join(root, "done"))
        check_modes(root, claim=options.claim, group=options.claim_group,
                    on_consumed=options.on_consumed, done_dir=self.done_dir)  # fmt: skip
        if options.on_consumed == "move":
            os.makedirs(self.done_dir, exist_ok=True)
        self._claims = ClaimStore(root, options.claim_group) if options.claim else None
        # Files are the reader's to tidy up when it consumes them exclusively.
        self._owns_files = options.claim or options.on_consumed != "keep"
        # Built on the main thread as a rule: waits on helper threads can then sleep in
        # flock with deadlines (only the main thread can install the wake handler).
        install_wake_handler()
        self._cancel = cancel
        # A follower of a group is a member of it while it follows: samples are then
        # shared out by ownership instead of every reader trying every claim.
        self.membership = (
            Membership(
                os.path.dirname(self._claims.directory), options.claim_group, self._claims.owner
            )
            if self._claims is not None and options.follow and options.names is None
            else None
        )
        self.source: SnapshotSource | FollowSource | None = None
        self._stream: CompletionStream | None = None
        # Keyed samples yielded and not yet consumed: their keys are recorded when they
        # are deleted or moved (``consumed_keys``), for ``consumed_key_retention``.
        self._remembers_keys = options.on_consumed != "keep" and options.consumed_key_retention > 0
        self._keyed: set[str] = set()

    def _open_stream(self, names: Sequence[str] | None) -> CompletionStream:
        options = self.options
        source: SnapshotSource | FollowSource
        membership = None
        if names is not None:
            source = SnapshotSource(self.root, names, watch=options.watch)
        elif options.follow:
            membership = self.membership
            rescan = options.rescan_interval
            if membership is not None:
                # A member learns of samples it does not own from rescans, in time to
                # stand in for their owners (its watch passes it only its own).
                rescan = min(rescan, options.claim_steal_after)
                membership.join()
            source = FollowSource(
                self.root,
                watch=options.watch,
                rescan_interval=rescan,
                poll_interval=options.poll_interval,
            )
        else:
            source = SnapshotSource(self.root, options.names, watch=options.watch)
            if options.names is None and not source.has_news():
                log.warning("%s", describe_empty(self.root))
            elif options.names is not None:
                _warn_absent(self.root, options.names)
        self.source = source
        decider = Decider(
            self.root,
            options,
            claims=self._claims,
            grace=options.orphan_grace,
            claim_retry=max(options.rescan_interval, 1.0),
            lock_type=SharedLock,
            membership=membership,
            steal_after=options.claim_steal_after,
            # A snapshot (or an epoch's names) yields a complete file of our writers
            # without its lock; a follower keeps to the lock protocol.
            published_unlocked=isinstance(source, SnapshotSource),
        )
        if decider.ownership is not None and isinstance(source, FollowSource):
            source.only_events_for(decider.ownership.owns_as_last_seen)
        self._stream = CompletionStream(
            source,
            decider,
            self._cancel,
            lock_timeout=options.lock_timeout,
            idle_timeout=options.idle_timeout,
            poll_interval=options.poll_interval,
        )
        return self._stream

    def outcomes(self, names: Sequence[str] | None = None) -> Generator[Outcome, None, None]:
        """Decided samples of the directory (or of ``names``), in completion order."""
        stream = self._open_stream(names)
        try:
            for outcome in stream:
                keyed = self._remembers_keys and outcome.kind is OutcomeKind.YIELD
                if keyed and self._is_consumed_copy(outcome):
                    continue
                yield outcome
        finally:
            stream.source.close()
            if self.membership is not None:
                self.membership.leave()  # the others take over this reader's share
            held = stream.waiting.held_names()
            if held and not self._cancel.cancelled:
                log.info("%s: stopped with %d sample(s) still being written", self.root, len(held))

    def _is_consumed_copy(self, outcome: Outcome) -> bool:
        """Drop a copy of a key consumed already (True); else note a keyed sample.

        A retry of a key that was in flight when the key's first sample was consumed
        publishes a second copy after it: the consumers remove it unread.
        """
        assert outcome.sample is not None
        metadata = outcome.sample.metadata
        if sample_key(metadata) is None:
            return False
        if not drops_copy(self.root, outcome.name, metadata):
            self._keyed.add(outcome.name)
            return False
        log.info("%s: its idempotency key was consumed already; removing this copy unread",
                 outcome.name)  # fmt: skip
        gone = _disposed(self.root, outcome.name, "delete", self.done_dir)
        settle(outcome.claim, Ending.GONE if gone else Ending.CONSUMED)
        if gone:
            self.forget(outcome.name)
        return True

    def _retention(self, name: str) -> float | None:
        """Seconds to remember the key of ``name`` once consumed (None: not keyed)."""
        if name not in self._keyed:
            return None
        self._keyed.discard(name)
        return self.options.consumed_key_retention

    def pending(self) -> list[str]:
        """Samples whose writer held the lock at the last look."""
        return [] if self._stream is None else self._stream.waiting.held_names()

    def set_aside(self, name: str, reason: str) -> bool:
        """Quarantine a rejected sample, but only when the reader owns the files."""
        if not self._owns_files:
            return False
        try:
            return quarantine(self.root, name, reason) is not None
        except OSError as exc:
            log.warning("cannot quarantine %s: %s", name, exc)
            return False

    def forget(self, name: str) -> None:
        """Drop a name whose files are gone (late events about it are ignored)."""
        if self.source is not None:
            self.source.forget(name)

    def consumed(self, name: str, claim: HeldClaim | None) -> None:
        """Keep, delete or move a delivered sample (``on_consumed``); settle its claim."""
        if claim is None and self.options.on_consumed == "keep":
            return  # nothing to do (asked after every sample)
        gone = _disposed(
            self.root, name, self.options.on_consumed, self.done_dir, self._retention(name)
        )
        settle(claim, Ending.GONE if gone else Ending.CONSUMED)
        if gone:
            self.forget(name)

    def receipt(self, name: str, claim: HeldClaim | None) -> DirectoryReceipt | None:
        """What ``consumed`` does, as a picklable record another process can settle."""
        if claim is None and self.options.on_consumed == "keep":
            return None
        claim_path = claim.path if isinstance(claim, Claim) else None
        return DirectoryReceipt(self.root, name, self.options.on_consumed, self.done_dir,
                                claim_path, self._retention(name))  # fmt: skip

    def released(self, name: str, claim: HeldClaim | None) -> None:
        """The receipt was settled by another process: close the claim, forget the name.

        Forgotten only if the file left the directory, as ``consumed`` does: a delete or
        move that failed there leaves a file that must not look new.
        """
        if isinstance(claim, Claim):
            claim.release()
        if self.options.on_consumed != "keep" and not os.path.lexists(
            os.path.join(self.root, name)
        ):
            self.forget(name)

    def watch_counters(self) -> WatchCounters | None:
        """The follow source's counters (None: not following, or not started yet)."""
        source = self.source
        if not isinstance(source, FollowSource):
            return None
        return WatchCounters(source.rescans, source.overflows, source.tracked)

    def close(self) -> None:
        """Stop watching the directory; a wait in progress returns."""
        if self.source is not None:
            self.source.close()
        if self.membership is not None:
            self.membership.leave()


def _warn_absent(root: str, names: Sequence[str]) -> None:
    """Say which of the names a reader was asked for are not in ``root`` at all.

    Such a name has neither its data file nor its lock: it was consumed and removed
    already, or it was never written here (with the Mooncake Store backend nothing is:
    read the store instead). The reader then yields nothing for it, and says so here
    rather than returning fewer samples without a word.
    """
    absent = [
        name
        for name in names
        if not os.path.lexists(os.path.join(root, name))
        and not os.path.lexists(lock_path(os.path.join(root, name)))
    ]
    if absent:
        shown = ", ".join(absent[:5]) + (", ..." if len(absent) > 5 else "")
        log.warning(
            "%d of the %d names asked for are not in %s (neither data file nor lock): %s. "
            "Consumed and removed already, or never written there; a sample of the "
            "Mooncake Store backend is read from its store: "
            "HiddenStateReader(STORE_URL, names=[hidden_states_key]) (docs/scale-out.md)",
            len(absent),
            len(names),
            root,
            shown,
        )


class DirectoryReceipt(NamedTuple):
    """``DirectoryBackend.consumed`` for a claim another process holds (``read.backend.Receipt``).

    Attributes:
        root: The storage directory.
        name: The sample.
        on_consumed: ``keep``, ``delete`` or ``move``.
        done_dir: Where ``move`` puts it.
        claim_path: The claim file, held by the process that read the sample (None
            without claims).
        key_retention: Seconds to remember the sample's idempotency key (None: it has
            none, or none is remembered).
    """

    root: str
    name: str
    on_consumed: str
    done_dir: str
    claim_path: str | None
    key_retention: float | None = None

    def settle(self) -> None:
        """Dispose of the sample, then settle its claim through the claim file's path."""
        gone = _disposed(self.root, self.name, self.on_consumed, self.done_dir, self.key_retention)
        if self.claim_path is not None:
            settle_claim_file(self.claim_path, gone)


def _disposed(
    root: str, name: str, on_consumed: str, done_dir: str, key_retention: float | None = None
) -> bool:
    """Apply ``on_consumed``; True if the files left the root (a failure is logged).

    With ``key_retention`` the sample's key is recorded as consumed first: a sample
    whose record cannot be written stays (else a retry would write it again).
    """
    try:
        if key_retention is not None and on_consumed != "keep":
            record_consumed(root, name, key_retention, on_consumed)
        return dispose(root, name, on_consumed, done_dir)
    except OSError as exc:
        log.warning("cannot %s %s after use: %s", on_consumed, name, exc)
        return False
