"""``HiddenStateLoader``: a DataLoader for ``HiddenStateDataset`` whose resume is exact.

Exactness comes from three things working together:

* the dataset deals its positions to workers in chunks of ``batch_size``
  (``hidden_state_reader.training.sharding.worker_chunks``), and the DataLoader returns the
  workers' batches round-robin, in order, so batch ``j`` is chunk ``j``;
* the collate function is wrapped so every batch carries how many positions it covers
  (a sample skipped as unreadable still counts: it occupied a position);
* the count is taken in the main process when the training loop receives a batch, never
  when a worker prefetches one.

So ``state_dict()`` holds ``(epoch, consumed)`` for this rank and nothing about workers:
a run resumed with another ``num_workers`` (or ``batch_size``) continues with exactly
the sample that comes next in the uninterrupted run.

With ``device=`` the batches are built by threads of this process instead of worker
processes (``device_feed``: build on the host, copy, finish on the device), dealt the
same chunks, so all of the above holds there too.

The loader reaches its dataset through public members and the ``LoaderBinding`` that
``HiddenStateDataset.bind_loader`` returns (pass, cursor, acknowledgements).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, get_worker_info

from hidden_state_reader.sample.placement import check_device
from hidden_state_reader.training.acknowledgement import Acknowledgements, Ticket
from hidden_state_reader.training.collate import pad_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.dataset_modes import Skipped
from hidden_state_reader.training.device_feed.builder_threads import DeviceFeed, FeedSettings
from hidden_state_reader.training.device_feed.host_build import HostArenas

_NOT_HERE = ("sampler", "batch_sampler", "shuffle")
# DataLoader arguments that mean something to builder threads (or nothing, harmlessly).
_FEED_ARGS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "in_order")


class _Counted(NamedTuple):
    """A collated batch, the number of positions it covers, and its ``Ticket``.

    A namedtuple, so the DataLoader's pin-memory thread pins the batch inside it.
    """

    positions: int
    batch: Any
    ticket: Ticket | None


class _CountingCollate:
    """Drops ``Skipped`` stand-ins, collates the rest, says how many positions it saw.

    Runs where the batch is built (a worker process, or the training process): it also
    takes the ticket of the items just read there.
    """

    def __init__(
        self, collate_fn: Callable[[list[Any]], Any], acknowledgements: Acknowledgements
    ) -> None:
        self.collate_fn = collate_fn
        self.acknowledgements = acknowledgements

    def __call__(self, items: Sequence[Any]) -> _Counted:
        samples = [item for item in items if not isinstance(item, Skipped)]
        batch = self.collate_fn(samples) if samples else None
        info = get_worker_info()
        consumer = 0 if info is None else info.id
        return _Counted(len(items), batch, self.acknowledgements.ticket(consumer))


class HiddenStateLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` for a ``HiddenStateDataset``, with exact resume.

    Iterating it runs the rest of the current epoch; after a complete pass the epoch
    advances (or call ``dataset.set_epoch(e)`` each epoch, as with
    ``DistributedSampler``; both agree). ``state_dict()`` taken at any batch and given
    to ``load_state_dict()`` of a fresh loader continues with the next sample of the
    uninterrupted run, also with a different ``num_workers``.

    Args:
        dataset: The dataset. The loader takes it over: it sets its chunk size to
            ``batch_size`` and counts what the training loop consumes.
        batch_size: Samples per batch.
        collate_fn: Builds a batch from a list of ``Sample`` objects (default:
            ``pad_collate``). Samples skipped as unreadable never reach it; a batch
            whose samples were all skipped is left out (under DDP that rank then has
            one step fewer: use ``on_error="raise"`` where that must not happen).
        drop_last: Drop the last, incomplete batch of each rank's epoch.
        device: Deliver batches on this device (``"cuda"``, ``"cuda:1"``, ...), built by
            ``num_workers`` threads (at least one) in reused page-locked buffers and
            copied on side streams while the loop trains; fp8 files cross as fp8 and
            are dequantized on the device. Then only ``num_workers``,
            ``prefetch_factor`` (batches built ahead per thread, default 2),
            ``pin_memory`` and ``persistent_workers`` (both meaningless there) and
            ``in_order`` are accepted. None (the default): an ordinary DataLoader.
        **kwargs: Other ``DataLoader`` arguments (``num_workers``, ``pin_memory``,
            ``prefetch_factor``, ``persistent_workers``, ``multiprocessing_context``,
            ...). ``in_order`` defaults to ``False`` in follow mode, where there is no
            order to keep; static mode needs ``True``.

    Raises:
        TypeError: ``dataset`` is not a ``HiddenStateDataset``.
        ValueError: Sampler/shuffle arguments (the dataset orders itself),
            ``in_order=False`` in static mode, several followers without claims, or a
            ``device`` with arguments only worker processes take.
    """

    dataset: HiddenStateDataset

    def __init__(
        self,
        dataset: HiddenStateDataset,
        batch_size: int = 1,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, HiddenStateDataset):
            raise TypeError(f"HiddenStateLoader needs a HiddenStateDataset, got {type(dataset)}")
        for key in _NOT_HERE:
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"{key}= does not apply: the dataset orders and shards itself "
                    "(HiddenStateDataset(shuffle=..., seed=...))"
                )
            kwargs.pop(key, None)
        if dataset.follow:
            kwargs.setdefault("in_order", False)
            dataset.options.check_consumers(kwargs.get("num_workers", 0), "DataLoader workers")
        elif kwargs.get("in_order", True) is False:
            raise ValueError("in_order=False would break the static order and exact resume")
        self.device = None if device is None else _feed_device(dataset, device, kwargs)
        self._feed_threads = max(1, kwargs.pop("num_workers", 0) or 0) if device else 0
        self._feed_prefetch = (kwargs.pop("prefetch_factor", None) or 2) if device else 0
        self._idle_arenas: list[list[HostArenas]] = []  # kept for the next pass
        if device is None:
            _check_device_workers(dataset, kwargs.get("num_workers", 0))
        self._binding = dataset.bind_loader(
            batch_size, 0 if device else kwargs.get("num_workers", 0) or 0
        )
        self.batch_collate_fn = collate_fn if collate_fn is not None else pad_collate
        self._handed_out: Ticket | None = None  # the batch the loop has now
        super().__init__(
            dataset,
            batch_size=batch_size,
            collate_fn=_CountingCollate(self.batch_collate_fn, self._binding.acknowledgements),
            drop_last=drop_last,
            **kwargs,
        )

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        binding = self._binding
        acknowledgements = binding.acknowledgements
        # Before workers start (or resume) and read the cursor.
        binding.begin_pass()
        workers_stay = bool(self.persistent_workers and self.num_workers)
        # Persistent workers are fresh too until DataLoader has made them.
        acknowledgements.begin_pass(fresh_workers=not workers_stay or self._iterator is None)
        batches = self._batches()
        try:
            for positions, batch, ticket in batches:
                binding.advance(positions)
                if batch is None:  # every sample skipped: nothing for the loop to train
                    acknowledgements.acknowledge(ticket)
                    continue
                self._handed_out = ticket
                yield batch
                self.commit()  # the loop asks for the next batch: it is past this one
        finally:
            batches.close()  # the workers or threads stop before the rest is given back
            self._handed_out = None
            # Persistent workers give back what the pass left now, not when they next read.
            acknowledgements.close_pass(workers_stay)
        binding.end_pass()

    def commit(self) -> None:
        """Record the samples of the batch the loop has now as consumed (e.g. at a checkpoint).

        Without it, a batch's samples are recorded (``on_consumed``, claims settled) when
        the loop asks for the next batch, or when the pass ends; a batch the loop holds
        when it stops early (``break``, an exception) or dies is delivered again.
        """
        ticket, self._handed_out = self._handed_out, None
        self._binding.acknowledgements.acknowledge(ticket)

    def _batches(self) -> Generator[tuple[int, Any, Ticket | None], None, None]:
        """``(positions, batch, ticket)`` from the worker processes, or the feed's threads."""
        if self.device is None:
            yield from super().__iter__()
            return
        arenas = self._idle_arenas.pop() if self._idle_arenas else None
        settings = FeedSettings(
            self.batch_size or 1,
            self.batch_collate_fn,
            self.drop_last,
            threads=self._feed_threads,
            prefetch=self._feed_prefetch,
            device=self.device,
        )
        dataset = self.dataset
        feed = DeviceFeed(self._binding, dataset.options, dataset.follow, settings, arenas)
        arenas = feed.arenas  # made by the feed on its first pass
        try:
            yield from feed
        finally:
            if arenas is not None:  # the threads are done with them (feed closed)
                self._idle_arenas.append(arenas)

    @property
    def epoch(self) -> int:
        """The epoch being (or next to be) read."""
        return self.dataset.epoch

    @property
    def consumed(self) -> int:
        """Positions of this rank's epoch delivered to the training loop so far."""
        return self.dataset.consumed

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: epoch and positions consumed (one per rank)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the next iteration yields the next sample in order.

        Raises:
            ValueError: The state does not fit this dataset (see
                ``HiddenStateDataset.load_state_dict``).
        """
        self.dataset.load_state_dict(state)


def _feed_device(
    dataset: HiddenStateDataset, device: str | torch.device, kwargs: dict[str, Any]
) -> torch.device:
    """The checked ``device=`` of the loader; refuses what only worker processes take."""
    parsed = check_device(device)
    if dataset.options.device is not None:
        raise ValueError(
            f"device={device!r} is given to both the dataset and HiddenStateLoader; give it "
            "to the loader only (it builds whole batches and moves them at once)"
        )
    others = sorted(set(kwargs) - set(_FEED_ARGS))
    if others:
        raise ValueError(
            f"HiddenStateLoader(device={device!r}) builds batches in threads of this "
            f"process; {', '.join(others)} only apply to worker processes (drop them, or "
            "leave device unset for an ordinary DataLoader)"
        )
    kwargs.pop("pin_memory", None)
    kwargs.pop("persistent_workers", None)
    return parsed


def _check_device_workers(dataset: HiddenStateDataset, num_workers: int) -> None:
    """A device other than the CPU is only reachable from the training process."""
    device = dataset.options.device
    if device is None or num_workers == 0 or torch.device(device).type == "cpu":
        return
    raise ValueError(
        f"device={device!r} with num_workers={num_workers}: worker processes cannot use the "
        "device (CUDA does not survive fork); give the device to the loader instead: "
        "HiddenStateLoader(dataset, ..., device=...) builds batches in threads and "
        "dequantizes fp8 on the device"
    )
