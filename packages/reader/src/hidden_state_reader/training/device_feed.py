"""``DeviceFeed``: batches built by threads in page-locked memory, put on the device early.

What ``HiddenStateLoader(..., device=...)`` iterates instead of DataLoader workers. Each
builder thread reads its share of the pass (the same chunks a DataLoader worker would
get, or its own claiming reader in follow mode), collates every batch straight into a
reused page-locked buffer (``HostArenas``: the only time the host touches the bytes,
copying them out of the page cache), and queues the copy to the device on its own CUDA
stream. fp8 files cross as fp8 codes plus scales and are dequantized there; a reader
``dtype`` is applied there too. The training loop receives batches already on the
device: it only makes its stream wait for the batch's copy.

Threads, not processes: reading is system calls and memory copies, which release the
GIL, and nothing has to cross a process boundary (docs/dependencies.md has the
measurements).

A process forked later (a DataLoader worker) must not free what the feed made: freeing a
page-locked buffer a copy read, a ``record_stream``ed tensor or a CUDA event calls CUDA,
which aborts a forked child. A child frees only the garbage it inherited, so a finished
feed is no reference cycle, and every ``fork`` of this process is preceded by a garbage
collection in the parent (``fork_safety``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hidden_state_reader.format import fp8
from hidden_state_reader.format.fp8 import SCALES
from hidden_state_reader.format.header import Meta
from hidden_state_reader.kernels.fp8 import dequantize
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.acknowledgement import Ticket
from hidden_state_reader.training.batch_memory import TensorSpec, carve, layout
from hidden_state_reader.training.dataset_modes import Reading, Skipped
from hidden_state_reader.training.fork_safety import collect_before_fork

if TYPE_CHECKING:
    from hidden_state_reader.reader import HiddenStateReader
    from hidden_state_reader.training.dataset import HiddenStateDataset

_DONE = object()
_PUT_WAIT = 0.1  # seconds between looks at the stop flag while a queue is full


@dataclass
class _Failed:
    """A builder thread's exception, raised again in the training loop."""

    error: BaseException


@dataclass
class _Built:
    """A batch on its way: positions it covers, the batch, its copy's event, its ticket."""

    positions: int
    batch: Any
    ready: torch.cuda.Event | None
    ticket: Ticket | None = None


class HostArenas:
    """One builder thread's reusable batch buffers (page-locked for a CUDA device).

    Batch ``k`` is built in buffer ``k % count``; before a buffer is reused, the copy
    that last read it is waited for. A batch larger than its buffer gets a larger one.

    Args:
        count: Buffers, so batch ``k + 1`` is built while batch ``k`` is copied.
        pin: Page-locked memory (CUDA), else ordinary memory.
    """

    def __init__(self, count: int, pin: bool) -> None:
        self.pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._copies: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def allocate(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Tensors for ``specs`` in the next buffer (an ``Allocate`` for the collates)."""
        index = self._next
        copy = self._copies[index]
        if copy is not None:
            copy.synchronize()  # this thread waits for the device to finish reading it
            self._copies[index] = None
        size = layout(specs)[1]
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < size:
            # Room for a quarter more: batch sizes vary, and page-locking is slow.
            size += size // 4
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[index] = buffer
        return carve(buffer, specs)

    def copied(self, event: torch.cuda.Event | None) -> None:
        """The batch just allocated is being copied out until ``event``; move on."""
        self._copies[self._next] = event
        self._next = (self._next + 1) % len(self._buffers)

    def settle(self) -> None:
        """Wait for the copies still reading the buffers and drop their events (between passes)."""
        for index, copy in enumerate(self._copies):
            if copy is not None:
                copy.synchronize()
                self._copies[index] = None


class Placement:
    """Moves a built batch to the device and finishes it there (fp8, dtype).

    Args:
        device: The target device.
        dequantize: Dequantize fp8 batches (``hidden_states`` + ``hidden_states_scales``)
            on the device; False keeps them raw (the reader's ``raw_fp8=True``).
        dtype: The reader's ``dtype``: the dtype of dequantized or converted hidden
            states (None: the writer's ``model_dtype`` for fp8, as stored otherwise).
    """

    def __init__(self, device: torch.device, dequantize: bool, dtype: torch.dtype | None) -> None:
        self.device = device
        self.dequantize = dequantize
        self.dtype = dtype
        self.cuda = device.type == "cuda"

    def place(
        self, batch: Any, samples: Sequence[Sample], stream: torch.cuda.Stream | None
    ) -> tuple[Any, torch.cuda.Event | None]:
        """The batch on the device, and the event its copies end with (None off CUDA).

        Args:
            batch: The built batch.
            samples: Its samples (their writers' ``model_dtype`` for fp8).
            stream: The builder thread's copy stream (CUDA only).
        """
        if stream is None:
            return self._finish(_to(batch, self.device), samples), None
        with torch.cuda.stream(stream):
            moved = self._finish(_to(batch, self.device), samples)
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event

    def _finish(self, batch: Any, samples: Sequence[Sample]) -> Any:
        if not isinstance(batch, dict) or "hidden_states" not in batch:
            return batch
        if SCALES in batch and self.dequantize:
            target = self.dtype or _model_dtype(samples)
            batch["hidden_states"] = dequantize(batch["hidden_states"], batch.pop(SCALES), target)
        elif SCALES not in batch and self.dtype is not None:
            batch["hidden_states"] = batch["hidden_states"].to(self.dtype)
        return batch


class DeviceFeed:
    """Iterates ``(positions, batch, ticket)`` for one pass of a dataset, batches on the device.

    The ticket says which samples the batch holds, to acknowledge once the loop is past
    it (``training.acknowledgement``; None when the dataset records nothing).

    Args:
        dataset: The dataset (its cursor says where the pass starts).
        batch_size: Samples per batch.
        collate_fn: Builds a batch; the pad and pack collates build it in place.
        drop_last: Leave out each thread's last, incomplete batch (as a DataLoader
            leaves out each worker's).
        threads: Builder threads.
        prefetch: Batches each thread builds ahead.
        device: Where batches go.
        arenas: Host buffers to build in, one ``HostArenas`` per thread, kept by the
            caller from pass to pass (page-locking memory is slow); made here if None.
    """

    def __init__(
        self,
        dataset: HiddenStateDataset,
        batch_size: int,
        collate_fn: Callable[..., Any],
        drop_last: bool,
        threads: int,
        prefetch: int,
        device: torch.device,
        arenas: list[HostArenas] | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.threads = threads
        self.prefetch = prefetch
        self.device = device
        options = dataset.options
        self.in_place = bool(getattr(collate_fn, "builds_in_place", False))
        # In-place collates carry fp8 scales: fp8 then crosses as fp8 and is dequantized
        # on the device, and dtype conversions happen there. Others get what the
        # options say, converted on the host.
        changes: dict[str, object] = {"pin_memory": False, "device": None}
        if self.in_place:
            changes.update(raw_fp8=True, dtype=None)
        self.placement = Placement(device, not options.raw_fp8, options.dtype)
        # Reused buffers only where the batch is copied out of them: on the CPU the
        # training loop keeps the built batch itself.
        reuse = self.in_place and self.placement.cuda
        if arenas is None and reuse:
            arenas = [HostArenas(2, pin=True) for _ in range(threads)]
        self.arenas = arenas if reuse else None
        collect_before_fork()  # a forked child frees none of this (fork_safety)
        # Not a method of the feed: no reference cycle keeps a finished feed (and what it
        # holds) for the garbage collector, in this process or a forked one.
        self._readers = _OpenReaders()
        self._reading = Reading(changes, self._readers)
        self._stop = threading.Event()
        ordered = not dataset.follow
        self._queues = [
            queue.Queue[Any](maxsize=prefetch) for _ in range(threads if ordered else 1)
        ]
        self._workers: list[threading.Thread] = []

    def __iter__(self) -> Iterator[tuple[int, Any, Ticket | None]]:
        self._workers = [
            threading.Thread(target=self._build, args=(i,), name=f"hidden-state-feed-{i}")
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.daemon = True
            worker.start()
        try:
            for built in self._arrivals():
                yield built.positions, _delivered(built, self.device), built.ticket
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads (their waits for writers end), wait for them, settle the buffers.

        The buffers' last copies are waited for and their events dropped, and the feed
        lets go of the buffers (the loader keeps them for its next pass).
        """
        self._stop.set()
        self._readers.close_all()
        for q in self._queues:  # a thread blocked on a full queue sees the stop flag
            _drain(q)
        for worker in self._workers:
            worker.join()
        self._workers = []
        for arenas in self.arenas or ():
            arenas.settle()
        self.arenas = None

    def _arrivals(self) -> Iterator[_Built]:
        """Built batches: round-robin over the threads (static order), else as they come."""
        live = list(range(len(self._queues)))
        finished = 0
        while live:
            for index in list(live):
                item = self._queues[index].get()
                if isinstance(item, _Failed):
                    # The traceback holds this frame: no local may hold the error (a cycle).
                    error, item = item.error, None
                    try:
                        raise error
                    finally:
                        del error
                if item is _DONE:
                    finished += 1
                    if len(self._queues) > 1 or finished == self.threads:
                        live.remove(index)
                    continue
                yield item

    def _build(self, worker: int) -> None:
        """One builder thread: read, collate, place; everything it makes goes to its queue."""
        out = self._queues[worker if len(self._queues) > 1 else 0]
        arenas = None if self.arenas is None else self.arenas[worker]
        stream = torch.cuda.Stream(self.device) if self.placement.cuda else None
        try:
            items = self.dataset._worker_items(worker, self.threads, self._reading)
            with closing(items):
                for chunk in _chunks(items, self.batch_size, self._stop):
                    if self.drop_last and len(chunk) < self.batch_size:
                        break
                    built = self._make(chunk, arenas, stream)
                    built.ticket = self.dataset._acknowledgements.ticket(worker)
                    if not self._put(out, built):
                        return
        except BaseException as exc:  # handed to the training loop
            self._put(out, _Failed(exc))
        finally:
            self._put(out, _DONE)

    def _make(
        self,
        chunk: list[Sample | Skipped],
        arenas: HostArenas | None,
        stream: torch.cuda.Stream | None,
    ) -> _Built:
        samples = [item for item in chunk if not isinstance(item, Skipped)]
        if not samples:
            return _Built(len(chunk), None, None)
        if arenas is not None:
            batch = self.collate_fn(samples, allocate=arenas.allocate)
        else:
            batch = self.collate_fn(samples)
        moved, event = self.placement.place(batch, samples, stream)
        if arenas is not None:
            arenas.copied(event)
        return _Built(len(chunk), moved, event)

    def _put(self, out: queue.Queue[Any], item: Any) -> bool:
        """Queue ``item`` unless the feed stops first (then False)."""
        while not self._stop.is_set():
            try:
                out.put(item, timeout=_PUT_WAIT)
                return True
            except queue.Full:
                continue
        return False


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
    items: Iterator[tuple[int, Sample | Skipped]], size: int, stop: threading.Event
) -> Iterator[list[Sample | Skipped]]:
    """Consecutive groups of ``size`` items (the last may be shorter)."""
    chunk: list[Sample | Skipped] = []
    for _, item in items:
        if stop.is_set():
            return
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _to(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` (dicts, lists, tuples) on ``device``, without blocking."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(value, device) for value in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def _delivered(built: _Built, device: torch.device) -> Any:
    """The batch, usable on the training loop's current stream."""
    if built.ready is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(built.ready)
        for tensor in _tensors(built.batch):
            if tensor.device.type == "cuda":
                # Memory made on the builder's stream and freed after use on this one.
                tensor.record_stream(current)
    return built.batch


def _model_dtype(samples: Sequence[Sample]) -> torch.dtype:
    """The one dtype fp8 samples of a batch dequantize to (the writers' ``model_dtype``)."""
    dtypes = {fp8.model_dtype(s.metadata.get(Meta.MODEL_DTYPE), s.path) for s in samples}
    if len(dtypes) > 1:
        raise ValueError(
            f"cannot batch fp8 samples whose writers recorded different model dtypes "
            f"({sorted(str(d) for d in dtypes)}, e.g. {samples[0].path}); pass dtype=... "
            "to the dataset"
        )
    return dtypes.pop()


def _drain(q: queue.Queue[Any]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
