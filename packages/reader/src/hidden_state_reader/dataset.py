"""``HiddenStateDataset``: hidden-state samples as a torch ``IterableDataset``.

Two modes:

* **static** (default): the sample list is taken once, at construction, so every rank
  and every DataLoader worker agrees on it. Each epoch has a deterministic order
  (``hidden_state_reader.sharding``): seeded shuffle, this rank's share, the first
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
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hidden_state_reader.discovery import describe_empty
from hidden_state_reader.errors import SampleError
from hidden_state_reader.format.header import read_header
from hidden_state_reader.health import count_states, scan_health
from hidden_state_reader.reader import HiddenStateReader
from hidden_state_reader.sample import Sample
from hidden_state_reader.sharding import (
    distributed_context,
    epoch_order,
    rank_share,
    rank_slice,
    worker_chunks,
)
from hidden_state_reader.states import GRACE
from hidden_state_reader.stats import ReaderStats

log = logging.getLogger(__name__)

STATE_VERSION = 1
_RESERVED = ("follow", "claim")


@dataclass(frozen=True)
class Skipped:
    """Stands in for a position whose sample could not be read (``HiddenStateLoader`` only).

    The loader counts it as consumed and drops it before collation, so the position
    count stays exact when ``on_error="skip"`` leaves a sample out.
    """

    name: str


class HiddenStateDataset(IterableDataset[Sample]):
    """Hidden-state samples of a directory written by vLLM, for ``torch.utils.data``.

    Use it with ``HiddenStateLoader`` for exact mid-epoch resume with any number of
    workers, or with any DataLoader (``num_workers=0`` keeps ``state_dict`` exact).

    Args:
        path: The storage directory.
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
        **reader_kwargs: Passed to ``HiddenStateReader`` (``layers``, ``layer_ids``,
            ``dtype``, ``pin_memory``, ``on_error``, ``lock_timeout``, ``on_consumed``,
            ``claim_group``, ``watch``, ``idle_timeout``, ...). In static mode
            ``names`` fixes the sample list (default: the directory's usable samples
            now: ready or still being written, see ``__len__``) and
            ``max_samples`` truncates every rank's epoch to that many positions; in
            follow mode ``max_samples`` stops each consumer after that many samples.

    Attributes:
        stats: Counters of the readers this process ran (each worker has its own).

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
        for key in _RESERVED:
            if key in reader_kwargs:
                raise TypeError(f"{key}= is a dataset argument, not a reader option")
        names = reader_kwargs.pop("names", None)
        if follow and names is not None:
            raise ValueError("names= fixes a static sample list; it cannot be followed")
        self.follow = follow
        self.claim = follow if claim is None else bool(claim)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.batch_size = _positive(batch_size, "batch_size")
        self.rank, self.world_size = distributed_context(rank, world_size)
        self.even_shards = even_shards
        if follow and not self.claim and self.world_size > 1:
            raise ValueError(
                f"follow mode with claim=False on {self.world_size} ranks would deliver every "
                "sample to every rank; use claim=True (the default in follow mode)"
            )
        # Static mode truncates the epoch itself (so len() and resume stay exact).
        max_samples = None if follow else reader_kwargs.pop("max_samples", None)
        if max_samples is not None and (not isinstance(max_samples, int) or max_samples < 0):
            raise ValueError(f"max_samples must be an integer >= 0, got {max_samples!r}")
        self._max_samples: int | None = max_samples
        self._reader_kwargs = reader_kwargs
        # Build one reader now so bad options fail here, not later inside a worker.
        self._make_reader([] if not follow else None)
        if follow:
            self._names: list[str] = []
        else:
            self._names = list(names) if names is not None else self._usable_names()
        digest = hashlib.sha1("\n".join(self._names).encode(), usedforsecurity=False)
        self._fingerprint = digest.hexdigest()[:16]
        self._epoch = 0
        self._consumed = 0
        self._bound = False  # set by HiddenStateLoader
        # [epoch, start]: what worker processes (persistent ones too) read at iter().
        self._shared = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._push()
        self._lengths: dict[str, int] = {}
        self.stats = ReaderStats()

    def _usable_names(self) -> list[str]:
        """The samples a reader will yield: ready, or still being written.

        The same rule as ``hidden-state stats`` and ``verify`` (``states.judge``); reads
        headers only.
        """
        grace = self._reader_kwargs.get("orphan_grace", GRACE)
        found = list(scan_health(self.root, grace=grace, include_temps=False))
        if not found:
            log.warning("%s", describe_empty(self.root))
        left_out = [h for h in found if not h.state.usable]
        if left_out:
            names = ", ".join(h.name for h in left_out[:5]) + (", ..." if len(left_out) > 5 else "")
            log.warning(
                "%s: %d of %d samples left out of the dataset as unusable (%s: %s); "
                "`hidden-state verify %s` lists them",
                self.root,
                len(left_out),
                len(found),
                ", ".join(f"{n} {s}" for s, n in count_states(left_out).items()),
                names,
                self.root,
            )
        return [h.name for h in found if h.state.usable]

    # -- what there is to read -------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the cursor."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Positions of this rank's epoch order that the training loop has consumed."""
        return self._consumed

    @property
    def num_samples(self) -> int:
        """Samples in the static list (all ranks together)."""
        self._require_static("num_samples")
        return len(self._names)

    def __len__(self) -> int:
        """Positions in one epoch of this rank (static mode only).

        Counts usable samples: the sample list holds those that were ready or still
        being written at construction (corrupt, incomplete, empty, failed and stale ones
        are left out, with a warning), sharded and truncated as the epoch is.
        """
        if self.follow:
            raise TypeError("a followed directory has no length")
        n = rank_share(len(self._names), self.rank, self.world_size, even=self.even_shards)
        return n if self._max_samples is None else min(n, self._max_samples)

    def epoch_names(self, epoch: int | None = None) -> list[str]:
        """This rank's sample names for an epoch (default: the cursor's), in read order."""
        self._require_static("epoch_names()")
        epoch = self._epoch if epoch is None else epoch
        order = epoch_order(self._names, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        mine = rank_slice(order, self.rank, self.world_size, even=self.even_shards)
        return mine if self._max_samples is None else mine[: self._max_samples]

    def lengths(self, epoch: int | None = None) -> list[int]:
        """Token counts of ``epoch_names(epoch)``, from the file headers only.

        For length-aware batching or token budgets; reads a few hundred bytes per file
        once (the counts are cached). A sample whose header cannot be read counts as 0
        tokens with a warning (it will be skipped), or raises with ``on_error="raise"``.
        """
        out = []
        for name in self.epoch_names(epoch):
            n = self._lengths.get(name)
            if n is None:
                try:
                    n = self._lengths[name] = read_header(os.path.join(self.root, name)).num_tokens
                except (SampleError, OSError) as exc:
                    if self._reader_kwargs.get("on_error") == "raise":
                        raise
                    log.warning("no length for %s: %s", name, exc)
                    n = 0
            out.append(n)
        return out

    # -- the cursor --------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (from its start); the current epoch keeps its position.

        Calling it every epoch, as with ``DistributedSampler``, is fine and also after
        ``load_state_dict``: the restored position is kept. Without calls, the epoch
        advances by itself after each complete pass.
        """
        if epoch != self._epoch:
            self._epoch, self._consumed = int(epoch), 0
        self._push()

    def state_dict(self) -> dict[str, Any]:
        """The cursor and what it depends on, for a checkpoint (one per rank)."""
        if get_worker_info() is not None:
            raise RuntimeError(
                "HiddenStateDataset.state_dict() was called in a DataLoader worker (e.g. by "
                "torchdata's StatefulDataLoader with num_workers > 0); a worker does not know "
                "what the training loop consumed. With worker processes use "
                "HiddenStateLoader(...).state_dict(), or keep num_workers=0"
            )
        return {
            "version": STATE_VERSION,
            "mode": "follow" if self.follow else "static",
            "epoch": self._epoch,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": None if self.follow else len(self._names),
            "fingerprint": None if self.follow else self._fingerprint,
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
        if not isinstance(state, Mapping) or "version" not in state:
            raise ValueError(f"not a HiddenStateDataset state: {state!r}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"state version {state['version']!r} is not {STATE_VERSION}")
        mine = self.state_dict()
        for key, what in _CHECKED:
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume: the checkpoint was taken with {what} {state[key]!r}, "
                    f"this dataset has {mine[key]!r}" + _HINTS.get(key, "")
                )
        consumed = int(state["consumed"])
        if consumed < 0 or (not self.follow and consumed > len(self)):
            raise ValueError(f"consumed={consumed} is outside this rank's epoch of {len(self)}")
        self._epoch = int(state["epoch"])
        self._consumed = consumed
        self._push()

    def _push(self) -> None:
        self._shared.copy_(torch.tensor([self._epoch, self._consumed], dtype=torch.int64))

    def _begin_pass(self) -> None:
        """Start (or continue) a pass: publish the cursor to the workers."""
        self._push()

    def _advance(self, positions: int) -> None:
        self._consumed += positions

    def _end_pass(self) -> None:
        """A complete pass over a static dataset: the next one is the next epoch."""
        if not self.follow:  # a followed stream has no epochs: keep counting
            self._epoch, self._consumed = self._epoch + 1, 0
            self._push()

    def _bind(self, batch_size: int) -> None:
        """Called by ``HiddenStateLoader``: chunk by its batch size, let it count."""
        self.batch_size = _positive(batch_size, "batch_size")
        self._bound = True

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Sample]:
        return cast(Iterator[Sample], self._iterate())

    def _iterate(self) -> Iterator[Sample | Skipped]:
        info = get_worker_info()
        counting = info is None and not self._bound
        if info is None:
            worker_id, num_workers = 0, 1
            if counting:
                self._begin_pass()
            epoch, start = self._epoch, self._consumed
        else:
            worker_id, num_workers = info.id, info.num_workers
            epoch, start = (int(v) for v in self._shared.tolist())
        if self.follow:
            yield from self._follow(num_workers, counting)
            return
        names = self.epoch_names(epoch)
        todo = list(enumerate(names))[start:]
        for position, name in worker_chunks(todo, worker_id, num_workers, self.batch_size):
            sample = None
            with closing(self._read_one(name)) as samples:
                for sample in samples:
                    if counting:
                        self._consumed = position + 1
                    yield sample
            if sample is None:
                if counting:
                    self._consumed = position + 1
                if self._bound:
                    yield Skipped(name)
        if counting:
            self._end_pass()

    def _read_one(self, name: str) -> Generator[Sample, None, None]:
        return self._samples(self._make_reader([name]))

    def _samples(self, reader: HiddenStateReader) -> Generator[Sample, None, None]:
        # Closing this generator closes the reader's, which settles the last sample.
        try:
            yield from reader
        finally:
            self.stats.merge(reader.stats)

    def _follow(self, num_workers: int, counting: bool) -> Iterator[Sample]:
        if not self.claim and num_workers > 1:
            raise ValueError(
                f"follow mode with claim=False and {num_workers} DataLoader workers would "
                "deliver every sample to every worker; use claim=True or num_workers<=1"
            )
        with closing(self._samples(self._make_reader(None))) as samples:
            for sample in samples:
                if counting:
                    self._consumed += 1
                yield sample
        if counting:
            self._end_pass()

    def _make_reader(self, names: Sequence[str] | None) -> HiddenStateReader:
        if self.follow:
            return HiddenStateReader(
                self.root, follow=True, claim=self.claim, **self._reader_kwargs
            )
        return HiddenStateReader(self.root, names=names, claim=self.claim, **self._reader_kwargs)

    def _require_static(self, what: str) -> None:
        if self.follow:
            raise TypeError(f"{what} needs a static dataset; this one follows {self.root}")

    def __repr__(self) -> str:
        mode = "follow" if self.follow else f"{len(self._names)} samples"
        return (
            f"HiddenStateDataset({self.root!r}, {mode}, rank {self.rank}/{self.world_size}, "
            f"epoch {self._epoch}, consumed {self._consumed})"
        )


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


def _positive(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value
