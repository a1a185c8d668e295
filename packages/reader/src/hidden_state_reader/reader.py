"""``HiddenStateReader``: discover -> wait for many writers at once -> decide -> consume.

One pipeline over every backend (``read.backend``): ``open_backend`` picks the backend
for a path (a directory, or a ``mooncake://`` store), the backend discovers, waits and
decides, and this module consumes: it applies the one error policy (``read.policy``),
yields each sample and records it as consumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from typing import TYPE_CHECKING

from hidden_state_reader.files.flockwait import CancelToken
from hidden_state_reader.format.consumed import DEFAULT_RETENTION
from hidden_state_reader.options import OnConsumed, OnError, ReaderOptions, Watch
from hidden_state_reader.read.backend import Backend, Outcome, Receipt
from hidden_state_reader.read.claim_lifecycle import Ending, settle
from hidden_state_reader.read.counters import ReaderStats, WatchCounters
from hidden_state_reader.read.directory import DirectoryBackend
from hidden_state_reader.read.holding import Holding
from hidden_state_reader.read.policy import ErrorPolicy
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import GRACE
from hidden_state_reader.store.url import is_store_url

if TYPE_CHECKING:
    import torch


def open_backend(path: str, options: ReaderOptions, cancel: CancelToken) -> Backend:
    """The backend that reads ``path``: a store for a ``mooncake://`` URL, else a directory.

    Args:
        path: A storage directory or a ``mooncake://HOST:PORT/PREFIX`` URL.
        options: The reader's options.
        cancel: Ends the backend's waits (the reader's ``close``).

    Raises:
        FileNotFoundError: ``path`` is not a directory (nor a store URL).
        ValueError: An option the backend does not support, or a bad URL.
    """
    if is_store_url(path):
        # Imported here: a directory reader never loads the store modules.
        from hidden_state_reader.store.backend import StoreBackend

        return StoreBackend(path, options, cancel)
    return DirectoryBackend(path, options, cancel)


class Delivery:
    """A sample handed out whose consumption is recorded later, when its user says so.

    What ``HiddenStateReader.deferred`` hands to its ``defer`` callback with each sample
    (``training.acknowledgement`` keeps them until the training loop is past them).
    Exactly one of ``commit``, ``give_back`` and (after settling ``receipt`` elsewhere)
    ``release`` is called.
    """

    __slots__ = ("_outcome", "_reader")

    def __init__(self, reader: HiddenStateReader, outcome: Outcome) -> None:
        self._reader = reader
        self._outcome = outcome

    @property
    def name(self) -> str:
        """The sample name."""
        return self._outcome.name

    def commit(self) -> None:
        """Record the sample as consumed (``on_consumed``, claim settled), here."""
        self._reader._commit(self._outcome)

    def receipt(self) -> Receipt | None:
        """What records it as consumed from another process, if the source has that."""
        return self._reader._backend.receipt(self._outcome.name, self._outcome.claim)

    def release(self) -> None:
        """Its ``receipt`` was settled: let go of the claim."""
        self._reader._backend.released(self._outcome.name, self._outcome.claim)

    def give_back(self) -> None:
        """Not used after all: return the claim so this or another reader delivers it."""
        settle(self._outcome.claim, Ending.RETURNED)


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
            ``mooncake://HOST:PORT/PREFIX`` store URL (``store.backend``).
        follow: Keep following the source as new samples appear (like ``tail -f``).
        idle_timeout: In follow mode, stop after this many seconds in which no sample
            became ready (a sample still being written is no news).
        max_samples: Stop after yielding this many samples.
        claim: Coordinate with other readers (processes, ranks, hosts on a shared
            filesystem) so each sample is yielded by exactly one of them.
        claim_group: Independent consumer groups each see every sample once.
        claim_steal_after: Following with ``claim=True``: seconds a sample may stay
            unclaimed by the group member that owns it before another member takes it
            (its owner died, left or is behind). See docs/scale-out.md.
        on_consumed: ``"keep"`` files, ``"delete"`` them after use (the loop asked for
            the next sample, or ``commit``; ``break`` gives back), or ``"move"`` them.
        done_dir: Target of ``on_consumed="move"`` (default ``<path>/done``).
        on_error: ``"skip"`` bad samples with one warning each (counted in ``stats``), or
            ``"raise"`` a ``SampleError`` subclass naming the file.
        lock_timeout: Seconds to wait for one sample's writer (it never delays other
            samples); None waits forever.
        names: Read exactly these sample names (no directory scan): complete ones in this
            order, each still being written when it is complete.
        watch: ``"auto"``, ``"inotify"`` or ``"poll"`` (NFS/Lustre with remote writers).
        rescan_interval: Safety rescan period in follow mode, seconds.
        poll_interval: Rescan period with ``watch="poll"``, seconds.
        orphan_grace: Seconds a released lock without data, or a lock-less file that does
            not parse, still counts as being written (``states.GRACE``, as the commands).
        consumed_key_retention: Seconds a sample named by an idempotency key is
            remembered after ``on_consumed`` deleted or moved it (7 days; 0: not at all):
            a retry of its key writes nothing meanwhile (docs/connector.md).
        layers: Keep only these positions of the layer axis (e.g. ``[-1]`` for the last).
        layer_ids: Keep only these captured layer ids (needs the writer's ``layer_ids`` metadata).
        dtype: Convert hidden states to this dtype.
        pin_memory: Read into page-locked memory (faster host-to-GPU copies).
        verify_checksum: Check the writer's CRC32 where there is one (a 2nd pass; ``LoadOptions``).
        mmap: Map files of ``MMAP_MIN_BYTES`` or more instead of copying them; turn off
            if your writer rewrites published files in place (``LoadOptions``).
        raw_fp8: Give fp8 files as stored (float8_e4m3fn plus ``Sample.hidden_states_scales``)
            instead of dequantizing them on the CPU (``LoadOptions``).
        device: Put the sample's tensors on this torch device, fp8 files crossing as fp8
            and dequantized there (``LoadOptions``); None (the default): the CPU.

    Attributes:
        root: ``path`` as given.
        options: The options (``ReaderOptions``).
        stats: What the reader did (``ReaderStats``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: Invalid options.
        TypeError: An unknown option.
        DirectoryNotWritableError: Claims, deletes or moves where this process cannot write.
    """

    _closed = False  # set by close()

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        idle_timeout: float | None = None,
        max_samples: int | None = None,
        claim: bool = False,
        claim_group: str = "default",
        claim_steal_after: float = 2.0,
        on_consumed: OnConsumed = "keep",
        done_dir: str | os.PathLike[str] | None = None,
        on_error: OnError = "skip",
        lock_timeout: float | None = 600.0,
        names: Sequence[str] | None = None,
        watch: Watch = "auto",
        rescan_interval: float = 30.0,
        poll_interval: float = 1.0,
        orphan_grace: float = GRACE,
        consumed_key_retention: float = DEFAULT_RETENTION,
        layers: Sequence[int] | None = None,
        layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
        verify_checksum: bool = False,
        mmap: bool = True,
        raw_fp8: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        self.root = os.fspath(path)
        self.options = ReaderOptions(
            follow=follow,
            idle_timeout=idle_timeout,
            max_samples=max_samples,
            claim=claim,
            claim_group=claim_group,
            claim_steal_after=claim_steal_after,
            on_consumed=on_consumed,
            done_dir=done_dir,
            on_error=on_error,
            lock_timeout=lock_timeout,
            names=names,
            watch=watch,
            rescan_interval=rescan_interval,
            poll_interval=poll_interval,
            orphan_grace=orphan_grace,
            consumed_key_retention=consumed_key_retention,
            layers=layers,
            layer_ids=layer_ids,
            dtype=dtype,
            pin_memory=pin_memory,
            verify_checksum=verify_checksum,
            mmap=mmap,
            raw_fp8=raw_fp8,
            device=device,
        )
        self._cancel = CancelToken()
        self._backend = open_backend(self.root, self.options, self._cancel)
        self._holding = Holding(self._commit)
        self.stats = ReaderStats()

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> HiddenStateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._holding.give_back()  # a loop still holding one never finished it
        self.close()

    def close(self) -> None:
        """Stop iterating; safe to call from another thread, or more than once.

        A wait for a writer in progress is interrupted, the directory watcher stops, and
        the iterator ends: the sample the loop holds is recorded when the loop asks for
        the next one, as always (a loop that stops first gives it back).
        """
        self._closed = True
        self._cancel.cancel()
        self._backend.close()

    def commit(self) -> None:
        """Record the sample the loop holds as consumed now (``on_consumed``, its claim).

        Otherwise that happens when the loop asks for the next sample, and a loop that
        stops first (``break``, an exception) gives the sample back: docs/reader.md,
        "What does a crash lose?". Nothing held: nothing to do.
        """
        self._holding.commit()

    @property
    def pending(self) -> list[str]:
        """Names of samples whose writer held the lock at the last look (still coming)."""
        return self._backend.pending()

    @property
    def watch_counters(self) -> WatchCounters | None:
        """The directory watch's counters while following, else None (``WatchCounters``)."""
        return self._backend.watch_counters()

    # -- iteration ---------------------------------------------------------------

    def __iter__(self) -> Generator[Sample, None, None]:
        return self._consume(None, self.options.max_samples)

    def deferred(self, defer: Callable[[Delivery], None]) -> Generator[Sample, None, None]:
        """Iterate, leaving each sample's consumption to ``defer``'s receiver.

        As ``iter(reader)``, but a sample is not recorded as consumed when the next one is
        asked for: ``defer`` gets its ``Delivery`` (before the sample is yielded), and
        whoever keeps it commits, releases or gives it back. Its claim stays held
        until then; a process that dies first releases it to the group.
        """
        return self._consume(None, self.options.max_samples, defer)

    def in_order(
        self, names: Iterable[str], defer: Callable[[Delivery], None] | None = None
    ) -> Generator[tuple[str, Sample | None], None, None]:
        """Read ``names`` one after another, in this order; each waited for by itself.

        What the static ``HiddenStateDataset`` reads an epoch with: one reader for the
        whole pass, its exact order kept (a sample still being written holds up the ones
        after it, for at most ``lock_timeout``). ``max_samples`` does not apply.

        Args:
            names: The samples, in order.
            defer: Receives each sample's ``Delivery`` (see ``deferred``); None records
                a sample as consumed when the next one is asked for.

        Yields:
            ``(name, sample)`` for every name; ``sample`` is None when it was skipped
            (counted in ``stats``; with ``on_error="raise"`` it raises instead).
        """
        for name in names:
            sample = None
            with closing(self._consume([name], None, defer)) as samples:
                for sample in samples:
                    yield name, sample
            if sample is None:
                yield name, None

    def _consume(
        self,
        names: list[str] | None,
        max_samples: int | None,
        defer: Callable[[Delivery], None] | None = None,
    ) -> Generator[Sample, None, None]:
        """One pass of the backend: policy, yield, record (``defer``: its receiver records)."""
        if self._closed or max_samples == 0:
            return
        policy = ErrorPolicy(
            self._backend, self.stats, on_error=self.options.on_error, follow=self.options.follow
        )
        yielded = 0
        with closing(self._backend.outcomes(names)) as outcomes:
            for outcome in outcomes:
                sample = policy.apply(outcome)
                if sample is None:
                    continue
                yielded += 1
                if defer is not None:
                    delivery = Delivery(self, outcome)
                    try:
                        defer(delivery)
                    except BaseException:
                        delivery.give_back()  # never left holding a claim nobody records
                        raise
                    yield sample
                else:
                    # Recorded when the caller asks for the next sample; given back if
                    # its loop stops first (``read.holding``).
                    yield from self._holding.deliver(outcome, sample)
                if max_samples is not None and yielded >= max_samples:
                    return

    def _commit(self, outcome: Outcome) -> None:
        """Record a delivered sample as consumed, even if Ctrl-C lands midway."""
        try:
            self._backend.consumed(outcome.name, outcome.claim)
        except KeyboardInterrupt:
            # Every step is repeatable: finish the record, then let the interrupt through
            # (a half-recorded claim would hand the sample to another reader again).
            self._backend.consumed(outcome.name, outcome.claim)
            raise
