"""The two modes of ``HiddenStateDataset``: a fixed sample list, or a followed source.

``StaticSamples`` owns what only a static dataset has: the sample list taken at
construction (and its fingerprint, for checkpoints), this rank's epoch orders, the
token lengths, and the reading of one epoch in order, dealt to DataLoader workers, with
one reader per pass (``HiddenStateReader.in_order``). ``FollowedSamples`` reads with one
reader that follows the source (and claims what it reads). Both yield
``(position, item)`` pairs and know nothing of the dataset: it counts the positions the
training loop consumed (``cursor``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Generator, Sequence
from contextlib import closing
from dataclasses import dataclass

from hidden_state_reader.errors import SampleError
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.listing import describe_empty
from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.read.counters import ReaderStats
from hidden_state_reader.reader import Delivery, HiddenStateReader
from hidden_state_reader.sample.health import count_states, scan_health
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.sharding import epoch_order, rank_share, rank_slice, worker_chunks

# The dataset's messages keep the dataset's logger name.
log = logging.getLogger("hidden_state_reader.training.dataset")


@dataclass(frozen=True)
class Skipped:
    """Stands in for a position whose sample could not be read (``HiddenStateLoader`` only).

    The loader counts it as consumed and drops it before collation, so the position
    count stays exact when ``on_error="skip"`` leaves a sample out.
    """

    name: str


@dataclass(frozen=True)
class Sharding:
    """How a static epoch is ordered and shared out (see ``training.sharding``).

    Attributes:
        seed: Base seed of the shuffle (the same on all ranks).
        shuffle: Shuffle each epoch (seeded with ``seed + epoch``).
        rank: This rank.
        world_size: Number of ranks.
        even_shards: Pad every rank's share to the same length by wrapping around.
    """

    seed: int
    shuffle: bool
    rank: int
    world_size: int
    even_shards: bool


class StaticSamples:
    """A static dataset's sample list and epochs.

    Args:
        root: The storage directory.
        options: The reader options.
        sharding: The order and share of each epoch.
        names: The sample list; None takes the directory's usable samples now.
        max_samples: Truncate every epoch of this rank to this many positions.
    """

    def __init__(
        self,
        root: str,
        options: ReaderOptions,
        sharding: Sharding,
        names: Sequence[str] | None,
        max_samples: int | None,
    ) -> None:
        self.root = root
        self.options = options
        self.sharding = sharding
        self.names = list(names) if names is not None else usable_names(root, options)
        digest = hashlib.sha1("\n".join(self.names).encode(), usedforsecurity=False)
        self.fingerprint = digest.hexdigest()[:16]
        self.max_samples = max_samples
        self._lengths: dict[str, int] = {}

    def __len__(self) -> int:
        """Positions in one epoch of this rank."""
        sh = self.sharding
        n = rank_share(len(self.names), sh.rank, sh.world_size, even=sh.even_shards)
        return n if self.max_samples is None else min(n, self.max_samples)

    def epoch_names(self, epoch: int) -> list[str]:
        """This rank's sample names for ``epoch``, in read order."""
        sh = self.sharding
        order = epoch_order(self.names, seed=sh.seed, epoch=epoch, shuffle=sh.shuffle)
        mine = rank_slice(order, sh.rank, sh.world_size, even=sh.even_shards)
        return mine if self.max_samples is None else mine[: self.max_samples]

    def lengths(self, epoch: int) -> list[int]:
        """Token counts of ``epoch_names(epoch)`` from the headers (cached; 0 if unreadable)."""
        out = []
        for name in self.epoch_names(epoch):
            n = self._lengths.get(name)
            if n is None:
                try:
                    n = self._lengths[name] = read_header(os.path.join(self.root, name)).num_tokens
                except (SampleError, OSError) as exc:
                    if self.options.on_error == "raise":
                        raise
                    log.warning("no length for %s: %s", name, exc)
                    n = 0
            out.append(n)
        return out

    def iterate(
        self, epoch: int, start: int, worker_id: int, num_workers: int, batch_size: int,
        stats: ReaderStats, reading: Reading | None = None, defer: Defer | None = None,
    ) -> Generator[tuple[int, Sample | Skipped], None, None]:  # fmt: skip
        """Read ``epoch`` from position ``start``, this worker's chunks only, in order.

        Args:
            epoch: The epoch (its order).
            start: Positions of it already consumed.
            worker_id: This worker (or builder thread).
            num_workers: How many share the pass.
            batch_size: Positions per chunk.
            stats: The counters the reader adds to.
            reading: How to read, when not as ``self.options`` say (``Reading``).
            defer: Receives every item's ``Delivery`` (None for a skipped position)
                before it is yielded: its consumption is then left to the receiver
                (``training.acknowledgement``). None: as the reader records it.

        Yields:
            ``(position, sample)``, or ``(position, Skipped(name))`` for a position whose
            sample could not be read. The reader counts into ``stats``.
        """
        todo = list(enumerate(self.epoch_names(epoch)))[start:]
        mine = worker_chunks(todo, worker_id, num_workers, batch_size)
        reader = _open(self.root, self.options, stats, reading, names=[])
        reads = reader.in_order((name for _, name in mine), defer)
        with closing(reader), closing(reads):
            for (position, _), (name, sample) in zip(mine, reads, strict=True):
                if sample is None and defer is not None:
                    defer(None)
                yield position, Skipped(name) if sample is None else sample


class FollowedSamples:
    """A followed source: one reader per consumer, claiming what it reads.

    Args:
        root: The storage directory or store URL.
        options: The reader options (``follow=True``).
    """

    def __init__(self, root: str, options: ReaderOptions) -> None:
        self.root = root
        self.options = options

    def iterate(
        self,
        start: int,
        num_workers: int,
        stats: ReaderStats,
        reading: Reading | None = None,
        defer: Defer | None = None,
    ) -> Generator[tuple[int, Sample], None, None]:
        """Follow the source until the reader stops (``idle_timeout``, ``max_samples``).

        A followed stream has no order to resume in: positions count on from ``start``.

        Args:
            start: The first position's number.
            num_workers: How many consumers follow at once (checked against ``claim``).
            stats: The counters the reader adds to.
            reading: How to read, when not as ``self.options`` say (``Reading``).
            defer: Receives every sample's ``Delivery`` before it is yielded (see
                ``StaticSamples.iterate``).

        Raises:
            ValueError: Several workers without claims (each would get every sample).
        """
        self.options.check_consumers(num_workers, "DataLoader workers")
        reader = _open(self.root, self.options, stats, reading)
        # Closing the reader's iterator settles the sample last yielded (without defer).
        stream = iter(reader) if defer is None else reader.deferred(defer)
        with closing(reader), closing(stream) as samples:
            yield from enumerate(samples, start)


Defer = Callable[[Delivery | None], None]


@dataclass(frozen=True)
class Reading:
    """How a consumer other than a DataLoader worker reads (``DeviceFeed``'s threads).

    Attributes:
        changes: Reader options that replace the dataset's (e.g. ``raw_fp8=True``).
        opened: Called with each reader opened, so its owner can close it from another
            thread (a reader's ``close`` interrupts its waits).
    """

    changes: dict[str, object]
    opened: Callable[[HiddenStateReader], None]


def _open(
    root: str,
    options: ReaderOptions,
    stats: ReaderStats,
    reading: Reading | None,
    names: Sequence[str] | None = None,
) -> HiddenStateReader:
    if reading is None:
        return open_reader(root, options, stats, names)
    reader = open_reader(root, ReaderOptions(**options.as_kwargs(**reading.changes)), stats, names)
    reading.opened(reader)
    return reader


def open_reader(
    root: str, options: ReaderOptions, stats: ReaderStats, names: Sequence[str] | None = None
) -> HiddenStateReader:
    """A reader of ``root`` with ``options`` (and, given, exactly ``names``).

    It counts into ``stats`` (the dataset's counters, live while it reads).
    """
    changes = {} if names is None else {"names": names}
    reader = HiddenStateReader(root, **options.as_kwargs(**changes))
    reader.stats = stats
    return reader


def usable_names(root: str, options: ReaderOptions) -> list[str]:
    """The samples a reader will yield now: ready, or still being written.

    The same rule as ``hidden-state stats`` and ``verify`` (``health.check_sample``, with
    the dataset's load options and ``orphan_grace``): no tensors are loaded, and what it
    leaves out is what the dataset's readers would reject. Warns about what it leaves out.
    """
    found = list(
        scan_health(root, grace=options.orphan_grace, include_temps=False, options=options)
    )
    if not found:
        log.warning("%s", describe_empty(root))
    left_out = [h for h in found if not h.state.usable]
    if left_out:
        names = ", ".join(h.name for h in left_out[:5]) + (", ..." if len(left_out) > 5 else "")
        log.warning(
            "%s: %d of %d samples left out of the dataset as unusable (%s: %s); "
            "`hidden-state verify %s` lists them",
            root,
            len(left_out),
            len(found),
            ", ".join(f"{n} {s}" for s, n in count_states(left_out).items()),
            names,
            root,
        )
    return [h.name for h in found if h.state.usable]
