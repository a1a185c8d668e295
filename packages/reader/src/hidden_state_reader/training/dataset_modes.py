"""The two modes of ``HiddenStateDataset``: a fixed sample list, or a followed directory.

``StaticSamples`` owns what only a static dataset has: the sample list taken at
construction (and its fingerprint, for checkpoints), this rank's epoch orders, the
token lengths, and the reading of one epoch in order, dealt to DataLoader workers.
``FollowedSamples`` reads with one reader that follows the directory (and claims what it
reads). Both read through their dataset (its options, sharding and cursor), which
counts what the training loop consumed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hidden_state_reader.errors import SampleError
from hidden_state_reader.format.header import read_header
from hidden_state_reader.read.sources import describe_empty
from hidden_state_reader.sample.health import count_states, scan_health
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.sharding import epoch_order, rank_share, rank_slice, worker_chunks

if TYPE_CHECKING:
    from hidden_state_reader.training.dataset import HiddenStateDataset

# The dataset's messages keep the dataset's logger name.
log = logging.getLogger("hidden_state_reader.training.dataset")


@dataclass(frozen=True)
class Skipped:
    """Stands in for a position whose sample could not be read (``HiddenStateLoader`` only).

    The loader counts it as consumed and drops it before collation, so the position
    count stays exact when ``on_error="skip"`` leaves a sample out.
    """

    name: str


class StaticSamples:
    """A static dataset's sample list and epochs.

    Args:
        dataset: The dataset (its root, options, shuffle, seed and sharding).
        names: The sample list; None takes the directory's usable samples now.
        max_samples: Truncate every epoch of this rank to this many positions.
    """

    def __init__(
        self, dataset: HiddenStateDataset, names: Sequence[str] | None, max_samples: int | None
    ) -> None:
        self.dataset = dataset
        self.names = list(names) if names is not None else usable_names(dataset)
        digest = hashlib.sha1("\n".join(self.names).encode(), usedforsecurity=False)
        self.fingerprint = digest.hexdigest()[:16]
        self.max_samples = max_samples
        self._lengths: dict[str, int] = {}

    def __len__(self) -> int:
        """Positions in one epoch of this rank."""
        ds = self.dataset
        n = rank_share(len(self.names), ds.rank, ds.world_size, even=ds.even_shards)
        return n if self.max_samples is None else min(n, self.max_samples)

    def epoch_names(self, epoch: int) -> list[str]:
        """This rank's sample names for ``epoch``, in read order."""
        ds = self.dataset
        order = epoch_order(self.names, seed=ds.seed, epoch=epoch, shuffle=ds.shuffle)
        mine = rank_slice(order, ds.rank, ds.world_size, even=ds.even_shards)
        return mine if self.max_samples is None else mine[: self.max_samples]

    def lengths(self, epoch: int) -> list[int]:
        """Token counts of ``epoch_names(epoch)`` from the headers (cached; 0 if unreadable)."""
        out = []
        for name in self.epoch_names(epoch):
            n = self._lengths.get(name)
            if n is None:
                try:
                    path = os.path.join(self.dataset.root, name)
                    n = self._lengths[name] = read_header(path).num_tokens
                except (SampleError, OSError) as exc:
                    if self.dataset.options.on_error == "raise":
                        raise
                    log.warning("no length for %s: %s", name, exc)
                    n = 0
            out.append(n)
        return out

    def iterate(
        self, epoch: int, start: int, worker_id: int, num_workers: int, *, counting: bool
    ) -> Iterator[Sample | Skipped]:
        """Read ``epoch`` from position ``start``, this worker's chunks only, in order.

        With ``counting`` (iterated in the training process, no loader) the dataset's
        cursor follows each position; a position whose sample could not be read yields
        ``Skipped`` when a ``HiddenStateLoader`` counts instead.
        """
        ds = self.dataset
        todo = list(enumerate(self.epoch_names(epoch)))[start:]
        for position, name in worker_chunks(todo, worker_id, num_workers, ds.batch_size):
            sample = None
            with closing(ds._samples(ds._make_reader([name]))) as samples:
                for sample in samples:
                    if counting:
                        ds._consumed = position + 1
                    yield sample
            if sample is None:
                if counting:
                    ds._consumed = position + 1
                if ds._bound:
                    yield Skipped(name)
        if counting:
            ds._end_pass()


class FollowedSamples:
    """A followed directory: one reader per consumer, claiming what it reads.

    Args:
        dataset: The dataset (its root, options and ``claim``).
    """

    def __init__(self, dataset: HiddenStateDataset) -> None:
        self.dataset = dataset

    def iterate(
        self, epoch: int, start: int, worker_id: int, num_workers: int, *, counting: bool
    ) -> Iterator[Sample]:
        """Follow the directory until the reader stops (``idle_timeout``, ``max_samples``).

        The epoch and start do not apply (a followed stream has no order to resume in);
        with ``counting`` the dataset's cursor counts the samples.
        """
        ds = self.dataset
        if not ds.claim and num_workers > 1:
            raise ValueError(
                f"follow mode with claim=False and {num_workers} DataLoader workers would "
                "deliver every sample to every worker; use claim=True or num_workers<=1"
            )
        with closing(ds._samples(ds._make_reader(None))) as samples:
            for sample in samples:
                if counting:
                    ds._consumed += 1
                yield sample
        if counting:
            ds._end_pass()


def usable_names(dataset: HiddenStateDataset) -> list[str]:
    """The samples a reader will yield now: ready, or still being written.

    The same rule as ``hidden-state stats`` and ``verify`` (``health.check_sample``, with
    the dataset's load options and ``orphan_grace``): no tensors are loaded, and what it
    leaves out is what the dataset's readers would reject. Warns about what it leaves out.
    """
    root = dataset.root
    options = dataset.options
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
