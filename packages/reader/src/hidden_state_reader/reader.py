"""``HiddenStateReader``: discovery -> claim -> wait for the writer -> load -> consume.

Each stage is its own module; this one only composes them and decides what happens to
a name at each outcome.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from hidden_state_reader.claims import Claim, ClaimResult, ClaimStore
from hidden_state_reader.discovery import FollowSource, SnapshotSource
from hidden_state_reader.disposal import ACTIONS, dispose, quarantine
from hidden_state_reader.errors import (
    CorruptSampleError,
    FailedSampleError,
    IncompleteSampleError,
    LockTimeoutError,
    SampleError,
    StaleLockError,
    WaitCancelledError,
)
from hidden_state_reader.format.fileio import NotRegularFileError, open_regular
from hidden_state_reader.format.lockfile import SharedLock, read_status
from hidden_state_reader.format.names import lock_path
from hidden_state_reader.load import LoadOptions, load_fd
from hidden_state_reader.sample import Sample
from hidden_state_reader.stats import ReaderStats
from hidden_state_reader.waiting import CancelToken

log = logging.getLogger(__name__)

OnError = Literal["skip", "raise"]
OnConsumed = Literal["keep", "delete", "move"]


class HiddenStateReader:
    """Iterate over hidden-state samples in a directory written by vLLM.

    ``for token_ids, hidden_states in HiddenStateReader(path)`` reads what is there now.
    A sample whose writer still holds its lock is waited for (the reader sleeps in
    ``flock(LOCK_SH)`` and the kernel wakes it on release); a partial, corrupt or failed
    file is never yielded.

    Args:
        path: The storage directory (vLLM's ``shared_storage_path``).
        follow: Keep following the directory as new samples appear (like ``tail -f``).
        idle_timeout: In follow mode, stop after this many seconds without news (time
            spent waiting for a writer to finish a sample does not count; a writer
            still holding its lock after ``lock_timeout`` is no news).
        max_samples: Stop after yielding this many samples.
        claim: Coordinate with other readers (processes, ranks, hosts on a shared
            filesystem) so each sample is yielded by exactly one of them.
        claim_group: Independent consumer groups each see every sample once.
        on_consumed: ``"keep"`` files, ``"delete"`` them after use, or ``"move"`` them to
            ``done_dir``.
        done_dir: Target of ``on_consumed="move"`` (default ``<path>/done``).
        on_error: ``"skip"`` bad samples with one warning each (counted in ``stats``), or
            ``"raise"`` a ``SampleError`` subclass naming the file.
        lock_timeout: Seconds to wait for one sample's writer; None waits forever.
        names: Read exactly these sample names, in this order (no directory scan).
        layers: Keep only these positions of the layer axis.
        layer_ids: Keep only these captured layer ids (needs writer metadata).
        dtype: Convert hidden states to this dtype.
        pin_memory: Read into page-locked memory.
        verify_checksum: Check CRC32s recorded by the writer.
        mmap: Map files of 1 MiB or more instead of copying them (faster; the tensors stay
            valid after the file is deleted). Turn off if your writer rewrites published
            files in place.
        watch: ``"auto"``, ``"inotify"`` or ``"poll"`` (NFS/Lustre with remote writers).
        rescan_interval: Safety rescan period in follow mode, seconds.
        poll_interval: Rescan period with ``watch="poll"``, seconds.
        orphan_grace: How long a released lock without data may be young before it is
            declared stale, seconds.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        idle_timeout: float | None = None,
        max_samples: int | None = None,
        claim: bool = False,
        claim_group: str = "default",
        on_consumed: OnConsumed = "keep",
        done_dir: str | os.PathLike[str] | None = None,
        on_error: OnError = "skip",
        lock_timeout: float | None = 600.0,
        names: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
        verify_checksum: bool = False,
        mmap: bool = True,
        watch: str = "auto",
        rescan_interval: float = 30.0,
        poll_interval: float = 1.0,
        orphan_grace: float = 2.0,
    ) -> None:
        self.root = os.fspath(path)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"hidden-state directory does not exist: {self.root}")
        if on_consumed not in ACTIONS:
            raise ValueError(f"on_consumed must be one of {ACTIONS}, got {on_consumed!r}")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        if follow and names is not None:
            raise ValueError("names= lists a fixed set of samples; it cannot be followed")
        self.follow = follow
        self.idle_timeout = idle_timeout
        self.max_samples = max_samples
        self.on_consumed = on_consumed
        self.done_dir = os.fspath(done_dir) if done_dir else os.path.join(self.root, "done")
        if on_consumed == "move":
            os.makedirs(self.done_dir, exist_ok=True)
        self.on_error = on_error
        self.lock_timeout = lock_timeout
        self.orphan_grace = orphan_grace
        self._names = list(names) if names is not None else None
        self._watch = watch
        self._rescan_interval = rescan_interval
        self._poll_interval = poll_interval
        self._load = LoadOptions(layers, layer_ids, dtype, pin_memory, verify_checksum, mmap)
        self._claims = ClaimStore(self.root, claim_group) if claim else None
        # Files are the reader's to tidy up when it consumes them exclusively.
        self._owns_files = claim or on_consumed != "keep"
        self._cancel = CancelToken()
        self._source: SnapshotSource | FollowSource | None = None
        self._closed = False
        self.stats = ReaderStats()

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> HiddenStateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop iterating; safe to call from another thread, or more than once.

        A wait for a writer in progress is interrupted, the directory watcher stops, and
        the iterator ends (the sample last yielded counts as consumed).
        """
        self._closed = True
        self._cancel.cancel()
        if self._source is not None:
            self._source.close()

    # -- iteration ---------------------------------------------------------------

    def __iter__(self) -> Iterator[Sample]:
        if self._closed:
            return
        source: SnapshotSource | FollowSource
        if self.follow:
            source = FollowSource(
                self.root,
                watch=self._watch,
                rescan_interval=self._rescan_interval,
                poll_interval=self._poll_interval,
            )
        else:
            source = SnapshotSource(self.root, self._names, self._cancel)
        self._source = source
        yielded = 0
        last_news = time.monotonic()
        # Names whose last lock wait timed out: a writer stuck on them is no news, so
        # seeing them again must not keep a follow reader alive forever.
        stuck: set[str] = set()
        try:
            while not self._closed:
                if self.max_samples is not None and yielded >= self.max_samples:
                    return
                timeout = None
                if self.follow and self.idle_timeout is not None:
                    timeout = self.idle_timeout - (time.monotonic() - last_news)
                    if timeout <= 0:
                        return
                try:
                    name = source.next(timeout)
                except WaitCancelledError:
                    return
                if name is None:
                    return
                if name not in stuck:
                    last_news = time.monotonic()
                lock_timeouts = self.stats.lock_timeouts
                try:
                    outcome = self._take(source, name)
                except WaitCancelledError:
                    return
                if self.stats.lock_timeouts == lock_timeouts:
                    # Time spent waiting for a writer that finished (or died) is not
                    # idle time.
                    stuck.discard(name)
                    last_news = time.monotonic()
                else:
                    stuck.add(name)
                if outcome is None:
                    continue
                sample, claim = outcome
                self.stats.yielded += 1
                self.stats.bytes += sample.nbytes
                self.stats.tokens += sample.num_tokens
                yielded += 1
                try:
                    yield sample
                finally:
                    # Reached when the caller asks for the next sample or stops
                    # iterating: either way the sample was delivered.
                    self._commit(source, name, claim)
                last_news = time.monotonic()
        finally:
            source.close()

    def _take(
        self, source: SnapshotSource | FollowSource, name: str
    ) -> tuple[Sample, Claim | None] | None:
        """Claim, wait for and load one sample; None if it is not to be yielded."""
        claim: Claim | None = None
        if self._claims is not None:
            result = self._claims.try_claim(name)
            if result is ClaimResult.HELD:
                self.stats.claimed_elsewhere += 1
                # Look again later: if that reader dies, its claim must be taken over.
                source.defer(name, max(self._rescan_interval, 1.0))
                return None
            if result is ClaimResult.DONE:
                self.stats.done_elsewhere += 1
                return None
            assert isinstance(result, Claim)
            claim = result
            if claim.reclaimed:
                self.stats.reclaimed += 1
                log.info("took over %s from a reader that is gone", name)
        try:
            sample = self._wait_and_load(source, name, claim)
        except SampleError as exc:
            self._reject(name, exc, claim)
            return None
        except FileNotFoundError:  # removed while we looked at it
            self.stats.vanished += 1
            if claim is not None:
                claim.remove()
            return None
        except OSError as exc:  # permissions, symlink loops, I/O errors: this file only
            error = CorruptSampleError(os.path.join(self.root, name), f"cannot read: {exc}")
            self._reject(name, error, claim)
            return None
        except BaseException:
            if claim is not None:
                claim.abandon()
            raise
        if sample is None:
            return None
        if sample.num_tokens == 0:
            self._reject(name, CorruptSampleError(sample.path, "zero tokens"), claim, empty=True)
            return None
        return sample, claim

    def _wait_and_load(
        self, source: SnapshotSource | FollowSource, name: str, claim: Claim | None
    ) -> Sample | None:
        data_path = os.path.join(self.root, name)
        lock = SharedLock.acquire(data_path, timeout=self.lock_timeout, cancel=self._cancel)
        if lock is None:
            self.stats.lock_timeouts += 1
            if claim is not None:
                claim.abandon()
            if self.on_error == "raise":
                raise LockTimeoutError(data_path, f"still locked after {self.lock_timeout}s")
            log.warning(
                "%s: writer still holds the lock after %ss; %s",
                data_path,
                self.lock_timeout,
                "will look again later" if self.follow else "skipped",
            )
            if self.follow:
                source.defer(name, self.lock_timeout or 0.0)
            return None
        with lock:
            try:
                fd = open_regular(data_path)
            except NotRegularFileError as exc:
                raise CorruptSampleError(data_path, "not a regular file") from exc
            except FileNotFoundError:
                self._no_data(source, name, lock.existed, claim)
                return None
            try:
                return load_fd(fd, data_path, self._load)
            except IncompleteSampleError:
                if not lock.existed and self._may_still_grow(fd):
                    # No lock protects this file and it changed just now: a lock-less
                    # writer may still be writing. Look again once it has settled.
                    if claim is not None:
                        claim.abandon()
                    source.defer(name, self.orphan_grace)
                    return None
                raise
            finally:
                os.close(fd)

    def _may_still_grow(self, fd: int) -> bool:
        return time.time() - os.fstat(fd).st_mtime < self.orphan_grace

    def _no_data(
        self,
        source: SnapshotSource | FollowSource,
        name: str,
        lock_existed: bool,
        claim: Claim | None,
    ) -> None:
        """The writer is done (or there is no writer) but there is no data file."""
        data_path = os.path.join(self.root, name)
        lock_file = lock_path(data_path)
        if not lock_existed or not os.path.exists(lock_file):
            # Consumed and deleted by another reader, or removed by hand.
            self.stats.vanished += 1
            if claim is not None:
                claim.remove()
            source.forget(name)
            return None
        status = read_status(lock_file)
        if status.failed:
            raise FailedSampleError(data_path, f"writer reported failure: {status.reason}")
        try:
            age = time.time() - os.stat(lock_file).st_mtime
        except FileNotFoundError:
            age = float("inf")
        if age < self.orphan_grace:
            # vLLM's own connector creates the lock a moment before it locks it.
            if claim is not None:
                claim.abandon()
            source.defer(name, self.orphan_grace - age)
            return None
        raise StaleLockError(data_path, "lock released but the data file never appeared")

    def _reject(
        self, name: str, exc: SampleError, claim: Claim | None, *, empty: bool = False
    ) -> None:
        """Count, report and (when the reader owns the files) set aside a bad sample."""
        if empty:
            self.stats.empty += 1
        elif isinstance(exc, IncompleteSampleError):
            self.stats.incomplete += 1
        elif isinstance(exc, FailedSampleError):
            self.stats.failed += 1
        elif isinstance(exc, StaleLockError):
            self.stats.stale_locks += 1
        else:
            self.stats.corrupt += 1
        if self._owns_files:
            try:
                if quarantine(self.root, name, str(exc)) is not None:
                    self.stats.quarantined += 1
            except OSError as move_exc:
                log.warning("cannot quarantine %s: %s", name, move_exc)
        if claim is not None:
            claim.done()
        if self.on_error == "raise":
            raise exc
        log.warning("skipping %s", exc)

    def _commit(
        self, source: SnapshotSource | FollowSource, name: str, claim: Claim | None
    ) -> None:
        """Record a delivered sample as consumed, even if Ctrl-C lands midway."""
        try:
            self._consumed(source, name, claim)
        except KeyboardInterrupt:
            # Every step is repeatable: finish the record, then let the interrupt through
            # (a half-recorded claim would hand the sample to another reader again).
            self._consumed(source, name, claim)
            raise

    def _consumed(
        self, source: SnapshotSource | FollowSource, name: str, claim: Claim | None
    ) -> None:
        try:
            gone = dispose(self.root, name, self.on_consumed, self.done_dir)
        except OSError as exc:
            log.warning("cannot %s %s after use: %s", self.on_consumed, name, exc)
            gone = False
        if claim is not None:
            if gone:
                claim.remove()
            else:
                claim.done()
        if gone:
            source.forget(name)
