"""``HiddenStateReader``: discover -> wait for many writers at once -> decide -> consume.

Each stage is its own module: ``discovery`` finds names and file-system touches,
``stream`` keeps every sample still being written pending and hands out decisions in
completion order, ``decision`` decides about one sample (with ``states``, the one
sample-state rule), ``outcomes`` counts and reports each decision (warn or raise, set a
bad sample aside), ``disposal`` and ``claims`` settle it. This module composes them,
yields the samples and records each as consumed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hidden_state_reader.format.flockwait import CancelToken, install_wake_handler
from hidden_state_reader.format.lockfile import SharedLock
from hidden_state_reader.options import OnConsumed, OnError
from hidden_state_reader.read.access import check_modes
from hidden_state_reader.read.claims import Claim, ClaimStore
from hidden_state_reader.read.decision import Decider
from hidden_state_reader.read.disposal import ACTIONS, dispose
from hidden_state_reader.read.outcomes import OutcomeHandler
from hidden_state_reader.read.sources import FollowSource, SnapshotSource, describe_empty
from hidden_state_reader.read.stats import ReaderStats
from hidden_state_reader.read.stream import CompletionStream
from hidden_state_reader.sample.load import LoadOptions
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import GRACE
from hidden_state_reader.store.url import is_store_url

log = logging.getLogger(__name__)


class HiddenStateReader:
    """Iterate over hidden-state samples in a directory written by vLLM.

    ``for token_ids, hidden_states in HiddenStateReader(path)`` reads what is there now.
    Samples come in completion order: a complete sample is yielded at once, while samples
    whose writers still hold their locks are waited for all together (the kernel's
    file-system events say when a lock is released; ``flock`` decides), so one slow
    writer never holds up the others. A partial, corrupt or failed file is never
    yielded.

    Args:
        path: The storage directory (vLLM's ``shared_storage_path``), or a
            ``mooncake://HOST:PORT/PREFIX`` store URL (``store.reader.StoreReader``).
        follow: Keep following the directory as new samples appear (like ``tail -f``).
        idle_timeout: In follow mode, stop after this many seconds in which no sample
            became ready (a sample still being written is no news).
        max_samples: Stop after yielding this many samples.
        claim: Coordinate with other readers (processes, ranks, hosts on a shared
            filesystem) so each sample is yielded by exactly one of them.
        claim_group: Independent consumer groups each see every sample once.
        on_consumed: ``"keep"`` files, ``"delete"`` them after use, or ``"move"`` them to
            ``done_dir``.
        done_dir: Target of ``on_consumed="move"`` (default ``<path>/done``).
        on_error: ``"skip"`` bad samples with one warning each (counted in ``stats``), or
            ``"raise"`` a ``SampleError`` subclass naming the file.
        lock_timeout: Seconds to wait for one sample's writer (it never delays other
            samples); None waits forever.
        names: Read exactly these sample names (no directory scan): complete ones in this
            order, each still being written when it is complete.
        layers: Keep only these positions of the layer axis.
        layer_ids: Keep only these captured layer ids (needs writer metadata).
        dtype: Convert hidden states to this dtype.
        pin_memory: Read into page-locked memory.
        verify_checksum: Check CRC32s recorded by the writer.
        mmap: Map files of 1 MiB or more instead of copying them (faster; the tensors stay
            valid after the file is deleted). Turn off if your writer rewrites published
            files in place.
        raw_fp8: Yield files stored in fp8 as stored (``hidden_states`` float8_e4m3fn
            plus ``Sample.hidden_states_scales``) instead of dequantizing them on the
            CPU; dequantize on the GPU with ``hidden_state_reader.format.fp8.dequantize``.
        device: Yield the tensors on this torch device (``"cuda"``): moved as stored
            (fp8 files: fp8 plus scales, half the bytes of bf16; pinned staging for
            CUDA), then dequantized or converted there. None: the CPU.
        watch: ``"auto"``, ``"inotify"`` or ``"poll"`` (NFS/Lustre with remote writers).
        rescan_interval: Safety rescan period in follow mode, seconds.
        poll_interval: Rescan period with ``watch="poll"``, seconds.
        orphan_grace: How long a released lock without data, or a lock-less file that
            does not parse, may be young and still count as being written, seconds (the
            same grace as the ``hidden-state`` commands, ``states.GRACE``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: Invalid options.
        DirectoryNotWritableError: ``claim=True``, ``on_consumed="delete"`` or ``"move"``
            on a directory (or done folder) this process cannot write.
    """

    def __new__(cls, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> HiddenStateReader:
        """A ``mooncake://`` URL names a store, not a directory: build a ``StoreReader``."""
        if cls is HiddenStateReader and is_store_url(path):
            from hidden_state_reader.store.reader import StoreReader

            return super().__new__(StoreReader)
        return super().__new__(cls)

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
        raw_fp8: bool = False,
        device: str | torch.device | None = None,
        watch: str = "auto",
        rescan_interval: float = 30.0,
        poll_interval: float = 1.0,
        orphan_grace: float = GRACE,
    ) -> None:
        self.root = os.fspath(path)
        _check_options(self.root, follow=follow, names=names, on_consumed=on_consumed,
                       on_error=on_error)  # fmt: skip
        self.follow = follow
        self.idle_timeout = idle_timeout
        self.max_samples = max_samples
        self.on_consumed = on_consumed
        self.done_dir = os.fspath(done_dir) if done_dir else os.path.join(self.root, "done")
        check_modes(self.root, claim=claim, group=claim_group, on_consumed=on_consumed,
                    done_dir=self.done_dir)  # fmt: skip
        if on_consumed == "move":
            os.makedirs(self.done_dir, exist_ok=True)
        self.on_error = on_error
        self.lock_timeout = lock_timeout
        self.orphan_grace = orphan_grace
        self._names = list(names) if names is not None else None
        self._watch = watch
        self._rescan_interval = rescan_interval
        self._poll_interval = poll_interval
        self._load = LoadOptions(
            layers, layer_ids, dtype, pin_memory, verify_checksum, mmap, raw_fp8=raw_fp8,
            device=device,
        )
        self._claims = ClaimStore(self.root, claim_group) if claim else None
        # Files are the reader's to tidy up when it consumes them exclusively.
        self._owns_files = claim or on_consumed != "keep"
        # Built on the main thread as a rule: waits on helper threads can then sleep in
        # flock with deadlines (only the main thread can install the wake handler).
        install_wake_handler()
        self._cancel = CancelToken()
        self._source: SnapshotSource | FollowSource | None = None
        self._stream: CompletionStream | None = None
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

    @property
    def pending(self) -> list[str]:
        """Names of samples whose writer held the lock at the last look (still coming)."""
        return [] if self._stream is None else self._stream.waiting.held_names()

    # -- iteration ---------------------------------------------------------------

    def _open_stream(self) -> CompletionStream:
        source: SnapshotSource | FollowSource
        if self.follow:
            source = FollowSource(
                self.root,
                watch=self._watch,
                rescan_interval=self._rescan_interval,
                poll_interval=self._poll_interval,
            )
        else:
            source = SnapshotSource(self.root, self._names, watch=self._watch)
            if self._names is None and not source._fresh:
                log.warning("%s", describe_empty(self.root))
        self._source = source
        decider = Decider(
            self.root,
            self._load,
            claims=self._claims,
            grace=self.orphan_grace,
            claim_retry=max(self._rescan_interval, 1.0),
            lock_type=SharedLock,  # looked up now: instrumentation may replace it
        )
        self._stream = CompletionStream(
            source,
            decider,
            self._cancel,
            lock_timeout=self.lock_timeout,
            idle_timeout=self.idle_timeout,
            poll_interval=self._poll_interval,
        )
        return self._stream

    def __iter__(self) -> Iterator[Sample]:
        if self._closed or self.max_samples == 0:
            return
        stream = self._open_stream()
        source = stream.source
        handler = OutcomeHandler(
            self.root,
            on_error=self.on_error,
            owns_files=self._owns_files,
            lock_timeout=self.lock_timeout,
            follow=self.follow,
        )
        yielded = 0
        try:
            for outcome in stream:
                sample = handler.apply(outcome, source, self.stats)
                if sample is None:
                    continue
                yielded += 1
                try:
                    yield sample
                finally:
                    # Reached when the caller asks for the next sample or stops
                    # iterating: either way the sample was delivered.
                    self._commit(source, outcome.name, outcome.claim)
                if self.max_samples is not None and yielded >= self.max_samples:
                    return
        finally:
            source.close()
            if stream.waiting.held_names() and not self._closed:
                log.info(
                    "%s: stopped with %d sample(s) still being written",
                    self.root,
                    len(stream.waiting.held_names()),
                )

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


def _check_options(
    root: str, *, follow: bool, names: Sequence[str] | None, on_consumed: str, on_error: str
) -> None:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"hidden-state directory does not exist: {root}")
    if on_consumed not in ACTIONS:
        raise ValueError(f"on_consumed must be one of {ACTIONS}, got {on_consumed!r}")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if follow and names is not None:
        raise ValueError("names= lists a fixed set of samples; it cannot be followed")
