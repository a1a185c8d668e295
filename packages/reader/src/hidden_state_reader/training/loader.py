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

With ``device=`` the workers build each batch in a shared page-locked slot
(``batch_slots``) and send a handle; the training process copies it to the device on a
side stream (``placement``). Batches, counts and order are the same, so all of the above
holds there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, get_worker_info

from hidden_state_reader.sample.placement import check_device
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.batch_slots import SlotBatch, SlotReceiver, SlotRing
from hidden_state_reader.training.collate import pad_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.dataset_modes import Skipped
from hidden_state_reader.training.placement import (
    HostArenas,
    Placed,
    Placement,
    deliver,
    fp8_target,
)

_NOT_HERE = ("sampler", "batch_sampler", "shuffle")
# What in-place collates read: fp8 as stored (dequantized on the device), no conversion
# on the host (done on the device), no pinned copy per sample (the batch is pinned).
_DEVICE_READING = {"raw_fp8": True, "dtype": None, "pin_memory": False, "device": None}
# Devices whose batches workers build in shared slots (the CPU keeps its batches: plain
# shared memory serves it; tests add "cpu" to run the slot path without a GPU).
SLOT_DEVICE_TYPES = {"cuda"}


class _Counted(NamedTuple):
    """A collated batch and the number of positions it covers.

    A namedtuple, so the DataLoader's pin-memory thread pins the batch inside it.
    """

    positions: int
    batch: Any


class _CountingCollate:
    """Drops ``Skipped`` stand-ins, collates the rest, and says how many positions it saw."""

    def __init__(
        self, collate_fn: Callable[[list[Any]], Any], build: _DeviceBuild | None = None
    ) -> None:
        self.collate_fn = collate_fn
        self.build = build

    def __call__(self, items: Sequence[Any]) -> _Counted:
        samples = [item for item in items if not isinstance(item, Skipped)]
        if not samples:
            return _Counted(len(items), None)
        if self.build is not None:
            return _Counted(len(items), self.build(samples))
        return _Counted(len(items), self.collate_fn(samples))


class _DeviceBuild:
    """Builds a batch for ``device=``: in a worker's slot, or placed by this process.

    In a worker with an in-place collate: the batch goes into the worker's next slot and
    the handle is returned. In the training process (``num_workers=0``): the batch goes
    into a reused page-locked buffer and is placed on the device at once. Other collates
    build as usual; the training process then copies their batch to the device.
    """

    def __init__(self, collate_fn: Callable[..., Any], ring: SlotRing | None, place: Placement):
        self.collate_fn = collate_fn
        self.in_place = bool(getattr(collate_fn, "builds_in_place", False))
        self.ring = ring
        self.placement = place
        self.arenas: HostArenas | None = None  # made on first use, in this process only

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "arenas": None}

    def __call__(self, samples: list[Sample]) -> Any:
        in_worker = get_worker_info() is not None
        if not self.in_place:
            batch = self.collate_fn(samples)
            # A worker's batch crosses to the training process, which copies it to CUDA.
            return batch if in_worker and self.placement.cuda else self.placement.place(batch)
        fp8_dtype = fp8_target(samples)
        if in_worker and self.ring is not None:
            writer = self.ring.writer()
            return writer.handle(self.collate_fn(samples, allocate=writer.allocate), fp8_dtype)
        if not self.placement.cuda:  # the loop keeps the batch itself: fresh memory
            return self.placement.place(self.collate_fn(samples), fp8_dtype)
        if self.arenas is None:
            self.arenas = HostArenas(2, pin=True)
        placed = self.placement.place(
            self.collate_fn(samples, allocate=self.arenas.allocate), fp8_dtype
        )
        self.arenas.copied(placed.ready)
        return placed


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
        device: Deliver batches on this device (``"cuda"``, ``"cuda:1"``, ...): each
            worker builds its batches in shared page-locked slots and the copy to the
            device runs on a side stream while the loop trains; fp8 files cross as fp8
            and are dequantized on the device. ``pin_memory`` does not apply (slots are
            page-locked already) and workers are started each pass
            (``persistent_workers`` does not apply). None (the default): batches on the
            CPU, as a plain DataLoader gives them.
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
        dataset._bind(batch_size)
        self.batch_collate_fn = collate_fn if collate_fn is not None else pad_collate
        self.device = None if device is None else _loader_device(dataset, device, kwargs)
        build = self._device_build(dataset, kwargs) if self.device is not None else None
        if build is None:
            _check_device_workers(dataset, kwargs.get("num_workers", 0))
        super().__init__(
            dataset,
            batch_size=batch_size,
            collate_fn=_CountingCollate(self.batch_collate_fn, build),
            drop_last=drop_last,
            **kwargs,
        )
        self._slots = None if build is None or build.ring is None else build.ring
        self._receiver = (
            None if self._slots is None or build is None
            else SlotReceiver(self._slots, build.placement)
        )  # fmt: skip
        self._placement = None if build is None else build.placement

    def _device_build(self, dataset: HiddenStateDataset, kwargs: dict[str, Any]) -> _DeviceBuild:
        """How batches are built for ``device=`` (reading options, slots, placement)."""
        assert self.device is not None
        options = dataset.options
        placement = Placement(self.device, not options.raw_fp8, options.dtype)
        in_place = bool(getattr(self.batch_collate_fn, "builds_in_place", False))
        if in_place:
            dataset._reading_changes = dict(_DEVICE_READING)
        workers = kwargs.get("num_workers", 0) or 0
        ring = None
        if workers and in_place and self.device.type in SLOT_DEVICE_TYPES:
            prefetch = kwargs.get("prefetch_factor") or 2
            ring = SlotRing(workers, per_worker=prefetch + 2)
        return _DeviceBuild(self.batch_collate_fn, ring, placement)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        dataset = self.dataset
        dataset._begin_pass()  # before workers start (or resume) and read the cursor
        for positions, batch in self._batches():
            dataset._advance(positions)
            if batch is not None:
                yield batch
        dataset._end_pass()

    def _batches(self) -> Iterator[tuple[int, Any]]:
        """``(positions, batch)`` as the training loop receives them (on ``device``)."""
        if self.device is None:
            for counted in super().__iter__():
                yield counted.positions, counted.batch
            return
        if self._slots is not None:
            self._slots.new_pass(self.multiprocessing_context)
        try:
            for counted in super().__iter__():
                yield counted.positions, self._on_device(counted.batch)
        finally:
            if self._receiver is not None:
                self._receiver.end_pass()

    def _on_device(self, batch: Any) -> Any:
        """A worker's batch (a slot handle, or a plain batch) or a placed one, delivered."""
        assert self.device is not None and self._placement is not None
        if batch is None:
            return None
        if isinstance(batch, SlotBatch):
            assert self._receiver is not None
            batch = self._receiver.place(batch)
        elif not isinstance(batch, Placed):
            batch = self._placement.place(batch)
        return deliver(batch, self.device)

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


def _loader_device(
    dataset: HiddenStateDataset, device: str | torch.device, kwargs: dict[str, Any]
) -> torch.device:
    """The checked ``device=`` of the loader; drops the arguments it makes moot."""
    parsed = check_device(device)
    if dataset.options.device is not None:
        raise ValueError(
            f"device={device!r} is given to both the dataset and HiddenStateLoader; give it "
            "to the loader only (it builds whole batches and moves them at once)"
        )
    if kwargs.pop("persistent_workers", False):
        raise ValueError(
            "persistent_workers=True does not apply with device=: workers start each pass, "
            "so batch slots left by a pass that ended early are free again"
        )
    if kwargs.pop("pin_memory", False):
        pass  # batches are built in page-locked memory already
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
