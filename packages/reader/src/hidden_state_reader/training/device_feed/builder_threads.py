"""``DeviceFeed``: the builder threads that run the device feed's stages, in order.

Each thread reads its share of the pass, groups it into batches, and runs each batch
through ``host_build``, ``to_device`` and ``device_finishing`` (one instance of each
stage per thread, with the thread's buffers and stream); it takes the batch's ticket and
queues the batch. The training loop receives the batches round-robin over the threads
in static mode (the order a DataLoader gives its workers' batches), as they come in
follow mode. The threads, their bounded queues, stopping them and carrying a thread's
exception to the training loop are ``hidden_state_reader.stages.Stages``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.stages import Stages
from hidden_state_reader.training.acknowledgement import Ticket
from hidden_state_reader.training.dataset_modes import Reading, Skipped
from hidden_state_reader.training.device_feed.device_finishing import DeviceFinishing
from hidden_state_reader.training.device_feed.host_build import (
    HostArenas,
    HostBuild,
    builds_in_place,
)
from hidden_state_reader.training.device_feed.to_device import ToDevice, hand_over
from hidden_state_reader.training.fork_safety import collect_before_fork

if TYPE_CHECKING:
    from hidden_state_reader.reader import HiddenStateReader
    from hidden_state_reader.training.dataset import LoaderBinding


@dataclass
class _Built:
    """A batch on its way: positions it covers, the batch, its copy's event, its ticket."""

    positions: int
    batch: Any
    ready: torch.cuda.Event | None
    ticket: Ticket | None = None


@dataclass(frozen=True)
class FeedSettings:
    """How a ``DeviceFeed`` builds and delivers (the loader's arguments).

    Attributes:
        batch_size: Samples per batch.
        collate_fn: Builds a batch; an ``InPlaceCollate`` builds it in the host buffers.
        drop_last: Leave out each thread's last, incomplete batch (as a DataLoader
            leaves out each worker's).
        threads: Builder threads.
        prefetch: Batches each thread builds ahead.
        device: Where batches go.
    """

    batch_size: int
    collate_fn: Callable[..., Any]
    drop_last: bool
    threads: int
    prefetch: int
    device: torch.device


class DeviceFeed:
    """Iterates ``(positions, batch, ticket)`` for one pass of a dataset, batches on the device.

    The ticket says which samples the batch holds, to acknowledge once the loop is past
    it (``training.acknowledgement``; None when the dataset records nothing).

    Args:
        binding: What the loader drives on its dataset (each thread's share of the
            pass from the cursor, the acknowledgements).
        options: The dataset's reader options.
        follow: The dataset follows a directory (batches arrive as they come).
        settings: Batch size, collate, threads, device, ...
        arenas: Host buffers to build in, one ``HostArenas`` per thread, kept by the
            caller from pass to pass (page-locking memory is slow); made here if None.
    """

    def __init__(
        self,
        binding: LoaderBinding,
        options: ReaderOptions,
        follow: bool,
        settings: FeedSettings,
        arenas: list[HostArenas] | None = None,
    ) -> None:
        self.binding = binding
        self.settings = settings
        in_place = builds_in_place(settings.collate_fn)
        self.finishing = DeviceFinishing(options, on_device=in_place)
        # Reused buffers only where the batch is copied out of them: on the CPU the
        # training loop keeps the built batch itself.
        reuse = in_place and settings.device.type == "cuda"
        if arenas is None and reuse:
            arenas = [HostArenas(2, pin=True) for _ in range(settings.threads)]
        self.arenas = arenas if reuse else None
        collect_before_fork()  # a forked child frees none of this (fork_safety)
        # Not a method of the feed: no reference cycle keeps a finished feed (and what it
        # holds) for the garbage collector, in this process or a forked one.
        self._readers = _OpenReaders()
        self._reading = Reading(self.finishing.reading(), self._readers)
        self.follow = follow
        self._stages: Stages[_Built] | None = None

    def __iter__(self) -> Iterator[tuple[int, Any, Ticket | None]]:
        # Static mode: one queue per thread, taken round-robin (the order a DataLoader
        # gives its workers' batches); follow mode: one queue, batches as they come.
        def producer(worker: int) -> Callable[[], Iterator[_Built]]:
            return lambda: self._batches(worker, lambda: stages.stopping)

        stages = self._stages = Stages(
            [producer(i) for i in range(self.settings.threads)],
            capacity=self.settings.prefetch,
            name="hidden-state-feed",
            in_order=not self.follow,
            interrupt=self._readers.close_all,
            start=False,
        )
        stages.start()
        try:
            for built in stages:
                batch = hand_over(built.batch, built.ready, self.settings.device)
                yield built.positions, batch, built.ticket
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads (their waits for writers end), wait for them, settle the buffers.

        The buffers' last copies are waited for and their events dropped, and the feed
        lets go of the buffers (the loader keeps them for its next pass).
        """
        stages, self._stages = self._stages, None
        if stages is not None:
            stages.close()  # stops the threads (a full queue too), closes the readers
        self._readers.close_all()
        for arenas in self.arenas or ():
            arenas.settle()
        self.arenas = None

    def _batches(self, worker: int, stopping: Callable[[], bool]) -> Iterator[_Built]:
        """One builder thread's batches: read, then each batch through the stages."""
        settings = self.settings
        arenas = None if self.arenas is None else self.arenas[worker]
        build = HostBuild(settings.collate_fn, arenas)
        copy = ToDevice(settings.device)
        items = self.binding.thread_share(worker, settings.threads, self._reading)
        with closing(items):
            for chunk in _chunks(items, settings.batch_size, stopping):
                if settings.drop_last and len(chunk) < settings.batch_size:
                    break
                built = self._make(chunk, build, copy)
                built.ticket = self.binding.acknowledgements.ticket(worker)
                yield built

    def _make(self, chunk: list[Sample | Skipped], build: HostBuild, copy: ToDevice) -> _Built:
        """One batch through the stages: built on the host, copied, finished on the device."""
        samples = [item for item in chunk if not isinstance(item, Skipped)]
        if not samples:
            return _Built(len(chunk), None, None)
        finishing = self.finishing
        batch = build.build(finishing.batchable(samples))
        moved, event = copy.move(batch, lambda on_device: finishing.finish(on_device, samples))
        build.copied(event)
        return _Built(len(chunk), moved, event)


class _OpenReaders:
    """The readers the builder threads open (``Reading.opened``), to close from another thread.

    A reader's ``close`` interrupts its waits for writers; one opened after
    ``close_all`` is closed at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: list[HiddenStateReader] = []
        self._closed = False

    def __call__(self, reader: HiddenStateReader) -> None:
        with self._lock:
            self._readers.append(reader)
            closed = self._closed
        if closed:
            reader.close()

    def close_all(self) -> None:
        """Close every reader opened so far, and any opened later."""
        with self._lock:
            self._closed = True
            readers = list(self._readers)
        for reader in readers:
            reader.close()


def _chunks(
    items: Iterator[tuple[int, Sample | Skipped]], size: int, stopping: Callable[[], bool]
) -> Iterator[list[Sample | Skipped]]:
    """Consecutive groups of ``size`` items (the last may be shorter)."""
    chunk: list[Sample | Skipped] = []
    for _, item in items:
        if stopping():
            return
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
