"""``HiddenStateDataset``: hidden-state samples as a torch ``IterableDataset``.

Two modes:

* **static** (default): the sample list is taken once, at construction, so every rank
  and every DataLoader worker agrees on it. Each epoch has a deterministic order
  (``hidden_state_reader.training.sharding``): seeded shuffle, this rank's share, the first
  ``consumed`` positions skipped (resume), the rest dealt to workers in chunks of
  ``batch_size``. Samples are read in exactly that order.
* **follow**: every worker of every rank follows the directory as it grows and claims
  what it reads, so each sample is delivered once across all of them (the reader's
  claims make this work across processes and hosts).

The dataset keeps a cursor, ``(epoch, consumed)``: how far the training loop got. When
it is iterated in this process (``num_workers=0``, e.g. under torchdata's
``StatefulDataLoader``) it counts by itself; with worker processes,
``HiddenStateLoader`` counts the batches the loop receives. ``state_dict`` /
``load_state_dict`` save and restore the cursor. The cursor is mirrored into a small
shared-memory tensor, so persistent DataLoader workers see ``set_epoch`` and resumes.

``HiddenStateDataset`` holds what both modes share (the options, the sharding, the
cursor and its checkpoints) and hands what differs to its mode: ``StaticSamples`` (the
fixed sample list, its epoch orders, lengths and the reading of one epoch) or
``FollowedSamples`` (one claiming reader that follows the directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from torch.utils.data import IterableDataset, get_worker_info

from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.read.counters import ReaderStats
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.store.url import is_store_url, parse_store_url
from hidden_state_reader.training.acknowledgement import Acknowledgements, Ledger
from hidden_state_reader.training.cursor import Cursor
from hidden_state_reader.training.dataset_modes import (
    FollowedSamples,
    Reading,
    Sharding,
    Skipped,
    StaticSamples,
    open_reader,
)
from hidden_state_reader.training.sharding import distributed_context

STATE_VERSION = 1

Share = Generator[tuple[int, Sample | Skipped], None, None]
"""A consumer's share of a pass: ``(position, sample or Skipped stand-in)`` in order."""


@dataclass(frozen=True)
class LoaderBinding:
    """What a loader drives on the dataset it took over (``HiddenStateDataset.bind_loader``).

    The loader and its device feed reach the dataset through this and the dataset's
    public members only.

    Attributes:
        acknowledgements: Takes each batch's ticket and records its samples as consumed
            once the loop is past them (``training.acknowledgement``).
        begin_pass: Start (or continue) a pass: publish the cursor to the workers.
        advance: Count positions the training loop received.
        end_pass: A complete pass: a static dataset's next pass is its next epoch.
        thread_share: ``(thread, threads, reading)``: one builder thread's share of the
            pass from the cursor (chunks of ``batch_size`` dealt round-robin, as to
            DataLoader workers; in follow mode its own claiming reader).
    """

    acknowledgements: Acknowledgements
    begin_pass: Callable[[], None]
    advance: Callable[[int], None]
    end_pass: Callable[[], None]
    thread_share: Callable[[int, int, Reading], Share]


class HiddenStateDataset(IterableDataset[Sample]):
    """Hidden-state samples of a directory written by vLLM, for ``torch.utils.data``.

    Use it with ``HiddenStateLoader`` for exact mid-epoch resume with any number of
    workers, or with any DataLoader (``num_workers=0`` keeps ``state_dict`` exact).

    Args:
        path: The storage directory, or (follow mode only) a ``mooncake://`` store URL.
        follow: Follow the directory as it grows instead of reading a fixed list.
        claim: Claim samples so that each is read by one consumer only. ``None`` means
            ``True`` in follow mode and ``False`` in static mode (where the split between
            ranks and workers already gives every sample to one of them).
        shuffle: Shuffle the static order each epoch (seeded with ``seed + epoch``).
        seed: Base seed of the shuffle; must be the same on all ranks.
        batch_size: Batch size of the DataLoader reading this dataset. Workers get
            consecutive chunks of this many samples, so the batches arrive in exactly
            the rank's order (``HiddenStateLoader`` sets it for you).
        rank: This rank (default: detected, see ``distributed_context``).
        world_size: Number of ranks (default: detected).
        even_shards: Pad every rank's share to the same length by wrapping around, as
            ``DistributedSampler`` does, so no DDP rank runs out of batches first.
            ``False`` gives a plain partition (each sample exactly once per epoch).
        **reader_kwargs: ``HiddenStateReader`` options, kept as a ``ReaderOptions``
            (``layers``, ``layer_ids``, ``dtype``, ``pin_memory``, ``on_error``,
            ``lock_timeout``, ``on_consumed``, ``claim_group``, ``watch``,
            ``idle_timeout``, ...). In static mode ``names`` fixes the sample list
            (default: the directory's usable samples now: ready or still being written,
            see ``__len__``) and ``max_samples`` truncates every rank's epoch to that
            many positions; in follow mode ``max_samples`` stops each consumer after
            that many samples.

    Attributes:
        stats: Counters of the readers this process ran (each worker has its own).
        options: The reader options (``ReaderOptions``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: Invalid options, or follow mode without claims for several ranks.
        TypeError: An unknown reader option.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        claim: bool | None = None,
        shuffle: bool = False,
        seed: int = 0,
        batch_size: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        even_shards: bool = True,
        **reader_kwargs: Any,
    ) -> None:
        super().__init__()
        self.root = os.fspath(path)
        self.follow = follow
        self.claim = follow if claim is None else bool(claim)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.batch_size = _positive(batch_size, "batch_size")
        self.rank, self.world_size = distributed_context(rank, world_size)
        self.even_shards = even_shards
        names, max_samples = _dataset_only_options(self, reader_kwargs)
        # TypeError for an unknown option, ValueError for a bad value.
        self.options = ReaderOptions(follow=follow, claim=self.claim, **reader_kwargs)
        self.options.check_consumers(self.world_size, "ranks")
        self.stats = ReaderStats()
        if is_store_url(self.root):
            # Check the URL only: joining the store here would start Mooncake's threads
            # in a process that DataLoader then forks, and forked workers hang on joining.
            parse_store_url(self.root)
        else:  # open one reader now so bad options fail here, not later inside a worker
            open_reader(self.root, self.options, ReaderStats(), None if follow else []).close()
        sharding = Sharding(self.seed, shuffle, self.rank, self.world_size, even_shards)
        self._mode: StaticSamples | FollowedSamples = (
            FollowedSamples(self.root, self.options)
            if follow
            else StaticSamples(self.root, self.options, sharding, names, max_samples)
        )
        self._cursor = Cursor()
        self._bound = False  # set by bind_loader
        # What says when a loader's loop is past a sample (inactive until bound).
        self._acknowledgements = Acknowledgements()

    # -- what there is to read (static mode) -------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the cursor."""
        return self._cursor.epoch

    @property
    def consumed(self) -> int:
        """Positions of this rank's epoch order that the training loop has consumed."""
        return self._cursor.consumed

    @property
    def num_samples(self) -> int:
        """Samples in the static list (all ranks together)."""
        return len(self._static("num_samples").names)

    def __len__(self) -> int:
        """Positions in one epoch of this rank (static mode only).

        Counts usable samples: the sample list holds those that were ready or still
        being written at construction (corrupt, incomplete, empty, failed and stale ones
        are left out, with a warning), sharded and truncated as the epoch is.
        """
        if isinstance(self._mode, FollowedSamples):
            raise TypeError("a followed directory has no length")
        return len(self._mode)

    def epoch_names(self, epoch: int | None = None) -> list[str]:
        """This rank's sample names for an epoch (default: the cursor's), in read order."""
        return self._static("epoch_names()").epoch_names(self.epoch if epoch is None else epoch)

    def lengths(self, epoch: int | None = None) -> list[int]:
        """Token counts of ``epoch_names(epoch)``, from the file headers only.

        For length-aware batching or token budgets; reads a few hundred bytes per file
        once (the counts are cached). A sample whose header cannot be read counts as 0
        tokens with a warning (it will be skipped), or raises with ``on_error="raise"``.
        """
        return self._static("lengths()").lengths(self.epoch if epoch is None else epoch)

    def _static(self, what: str) -> StaticSamples:
        if isinstance(self._mode, FollowedSamples):
            raise TypeError(f"{what} needs a static dataset; this one follows {self.root}")
        return self._mode

    # -- the cursor --------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (from its start); the current epoch keeps its position.

        Calling it every epoch, as with ``DistributedSampler``, is fine and also after
        ``load_state_dict``: the restored position is kept. Without calls, the epoch
        advances by itself after each complete pass.
        """
        cursor = self._cursor
        cursor.move_to(epoch, cursor.consumed if epoch == cursor.epoch else 0)

    def state_dict(self) -> dict[str, Any]:
        """The cursor and what it depends on, for a checkpoint (one per rank)."""
        if get_worker_info() is not None:
            raise RuntimeError(
                "HiddenStateDataset.state_dict() was called in a DataLoader worker (e.g. by "
                "torchdata's StatefulDataLoader with num_workers > 0); a worker does not know "
                "what the training loop consumed. With worker processes use "
                "HiddenStateLoader(...).state_dict(), or keep num_workers=0"
            )
        static = None if isinstance(self._mode, FollowedSamples) else self._mode
        return {
            "version": STATE_VERSION,
            "mode": "follow" if static is None else "static",
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": None if static is None else len(static.names),
            "fingerprint": None if static is None else static.fingerprint,
            "world_size": self.world_size,
            "even_shards": self.even_shards,
            "rank": self.rank,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict`` (of this dataset or its loader).

        Raises:
            ValueError: The state belongs to a different setup: another sample set,
                seed, shuffle, world size or sharding, or an unknown version.
        """
        _check_resumable(state, self)
        consumed = int(state["consumed"])
        if consumed < 0 or (not self.follow and consumed > len(self)):
            raise ValueError(f"consumed={consumed} is outside this rank's epoch of {len(self)}")
        self._cursor.move_to(int(state["epoch"]), consumed)

    def _begin_pass(self) -> None:
        """Start (or continue) a pass: publish the cursor to the workers."""
        self._cursor.publish()

    def _advance(self, positions: int) -> None:
        self._cursor.consumed += positions

    def _end_pass(self) -> None:
        """A complete pass over a static dataset: the next one is the next epoch."""
        if not self.follow:  # a followed stream has no epochs: keep counting
            self._cursor.next_epoch()

    def bind_loader(self, batch_size: int, workers: int) -> LoaderBinding:
        """Hand the dataset over to a loader (``HiddenStateLoader`` calls it): what it drives.

        From now on the dataset deals chunks of ``batch_size``, counts only what the loader
        reports, and records samples as consumed when the loader acknowledges them;
        ``workers``: the loader's worker processes (0: none, or builder threads).
        """
        self.batch_size = _positive(batch_size, "batch_size")
        self._bound = True
        if self.options.claim or self.options.on_consumed != "keep":
            self._acknowledgements.activate(workers)
        share = partial(_thread_share, self, self._acknowledgements)
        return LoaderBinding(
            self._acknowledgements, self._begin_pass, self._advance, self._end_pass, share
        )

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Sample]:
        return cast(Iterator[Sample], self._iterate())

    def _iterate(self) -> Iterator[Sample | Skipped]:
        info = get_worker_info()
        # Iterated in the training process without a loader: the dataset counts itself.
        counting = info is None and not self._bound
        if info is None:
            worker_id, num_workers = 0, 1
            if counting:
                self._begin_pass()
            epoch, start = self.epoch, self.consumed
        else:
            worker_id, num_workers = info.id, info.num_workers
            epoch, start = self._cursor.published()
        ledger = self._acknowledgements.start(worker_id, in_worker=info is not None)
        if ledger is not None and ledger.pass_over:
            return  # a persistent worker late for a pass the loop has ended: read nothing
        items = _share(self, epoch, start, worker_id, num_workers, ledger)
        with closing(items):
            for position, item in items:
                if counting:
                    self._cursor.consumed = position + 1
                if isinstance(item, Skipped) and not self._bound:
                    continue  # only a loader counts a stand-in as a position
                yield item
                if ledger is not None:
                    ledger.catch_up()  # before the next read
        if counting:
            self._end_pass()

    def __repr__(self) -> str:
        mode = "follow" if self.follow else f"{self.num_samples} samples"
        return (
            f"HiddenStateDataset({self.root!r}, {mode}, rank {self.rank}/{self.world_size}, "
            f"epoch {self.epoch}, consumed {self.consumed})"
        )


def _thread_share(
    dataset: HiddenStateDataset, acknowledgements: Acknowledgements, thread: int, threads: int,
    reading: Reading,
) -> Share:  # fmt: skip
    """One of ``threads`` builder threads' share of the pass, from the cursor (``DeviceFeed``).

    Static mode deals chunks of ``batch_size`` positions round-robin, as to DataLoader
    workers; follow mode gives each its own claiming reader.
    """
    ledger = acknowledgements.start(thread, in_worker=False)
    return _share(dataset, dataset.epoch, dataset.consumed, thread, threads, ledger, reading)


def _share(
    dataset: HiddenStateDataset, epoch: int, start: int, worker_id: int, num_workers: int,
    ledger: Ledger | None, reading: Reading | None = None,
) -> Share:  # fmt: skip
    """One consumer's share of a pass from ``start`` (see the modes' ``iterate``).

    With a ``ledger``, each item's delivery is handed to it (``training.acknowledgement``).
    """
    mode, defer = dataset._mode, None if ledger is None else ledger.hand_out
    if isinstance(mode, FollowedSamples):
        return mode.iterate(start, num_workers, dataset.stats, reading, defer)
    return mode.iterate(
        epoch, start, worker_id, num_workers, dataset.batch_size, dataset.stats, reading, defer
    )


def _dataset_only_options(
    dataset: HiddenStateDataset, reader_kwargs: dict[str, Any]
) -> tuple[Sequence[str] | None, int | None]:
    """Check the mode's arguments; pop and return the static list's ``names``, ``max_samples``."""
    names = reader_kwargs.pop("names", None)
    if dataset.follow and names is not None:
        raise ValueError("names= fixes a static sample list; it cannot be followed")
    if is_store_url(dataset.root) and not dataset.follow:
        raise ValueError(
            f"{dataset.root}: a Mooncake Store has no fixed sample list to shard; use "
            "follow=True (docs/scale-out.md)"
        )
    # Static mode truncates the epoch itself (so len() and resume stay exact).
    max_samples = None if dataset.follow else reader_kwargs.pop("max_samples", None)
    if max_samples is not None and (not isinstance(max_samples, int) or max_samples < 0):
        raise ValueError(f"max_samples must be an integer >= 0, got {max_samples!r}")
    return names, max_samples


_CHECKED = (
    ("mode", "mode"),
    ("num_samples", "a sample count of"),
    ("fingerprint", "sample-list fingerprint"),
    ("seed", "seed"),
    ("shuffle", "shuffle="),
    ("world_size", "world_size"),
    ("even_shards", "even_shards="),
)
_HINTS = {
    "num_samples": " (the directory changed since; pass names= with the checkpoint's list)",
    "fingerprint": " (a different set of samples)",
    "world_size": " (positions are per rank; resume with the same number of ranks)",
}


def _check_resumable(state: Mapping[str, Any], dataset: HiddenStateDataset) -> None:
    """Raise ValueError unless ``state`` was saved by a dataset set up like this one."""
    if not isinstance(state, Mapping) or "version" not in state:
        raise ValueError(f"not a HiddenStateDataset state: {state!r}")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state version {state['version']!r} is not {STATE_VERSION}")
    mine = dataset.state_dict()
    for key, what in _CHECKED:
        if key in state and state[key] != mine[key]:
            raise ValueError(
                f"cannot resume: the checkpoint was taken with {what} {state[key]!r}, "
                f"this dataset has {mine[key]!r}" + _HINTS.get(key, "")
            )


def _positive(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value
