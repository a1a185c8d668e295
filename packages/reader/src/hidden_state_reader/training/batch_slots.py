"""Shared page-locked batch slots: workers build batches where the GPU copy reads them.

With ``HiddenStateLoader(..., device=...)`` each DataLoader worker process builds its
batches in its own ring of slots: shared-memory buffers that the training process has
page-locked (``cudaHostRegister``). Only a small ``SlotBatch`` handle crosses the
process boundary; the training process copies the slot straight to the device on a side
stream. The host touches each byte once, when the worker copies it out of the page
cache, and the training process's interpreter does almost nothing per batch (builder
threads in the training process slowed its kernel launches: docs/dependencies.md).

Flow control: worker ``w`` takes a slot from its semaphore before building and the
training process gives the slot back once the device copy out of it is done, so a slot
is never written while it is read. A slot is made by its worker on first use (or when a
batch outgrows it) and sent once with the handle; the training process keeps it, so the
workers of later passes reuse it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import get_worker_info

from hidden_state_reader.training.batch_memory import TensorSpec, carve, layout
from hidden_state_reader.training.placement import Placed, Placement

_SLOT_GRANULE = 2 << 20  # slots are whole 2 MiB units: fewer regrowths, aligned pinning


@dataclass
class SlotBatch:
    """What a worker sends for a batch built in slot ``slot`` of worker ``worker``.

    Attributes:
        worker: The worker (its DataLoader id).
        slot: The slot in the worker's ring.
        specs: The batch's tensors, as laid out in the slot (``batch_memory.layout``).
        fields: The batch's other entries (paths, ints), as the collate made them.
        storage: The slot's bytes when the training process does not have them yet
            (first use, or grown), else None.
        version: Increases each time the worker replaces the slot's buffer.
        fp8_dtype: What raw fp8 hidden states dequantize to (``placement.fp8_target``).
    """

    worker: int
    slot: int
    specs: list[TensorSpec]
    fields: dict[str, Any]
    storage: torch.Tensor | None = None
    version: int = 0
    fp8_dtype: torch.dtype | None = None


@dataclass
class SlotRing:
    """The slots of every worker and the semaphores that hand them out.

    Made by the training process; inherited (fork) or pickled (spawn) into the workers.
    Slots persist from pass to pass; the semaphores are new for each pass
    (``new_pass``), since a pass may end with batches that were built and never read.

    Args:
        workers: DataLoader workers.
        per_worker: Slots each worker cycles through (prefetch + 2: one being built, the
            prefetched ones, one being copied to the device).
    """

    workers: int
    per_worker: int
    slots: list[list[torch.Tensor | None]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    free: list[Any] = field(default_factory=list)
    _writer: SlotWriter | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.slots = [[None] * self.per_worker for _ in range(self.workers)]
        self.versions = [[0] * self.per_worker for _ in range(self.workers)]

    def new_pass(self, context: Any = None) -> None:
        """Fresh semaphores (every slot free) before the workers of a pass start."""
        context = context or multiprocessing.get_context()
        self.free = [context.Semaphore(self.per_worker) for _ in range(self.workers)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

    def writer(self) -> SlotWriter:
        """This worker's writer (made on first use inside the worker process)."""
        if self._writer is None:
            info = get_worker_info()
            if info is None:
                raise RuntimeError("slots are written by DataLoader workers only")
            self._writer = SlotWriter(self, info.id)
        return self._writer


class SlotWriter:
    """A worker's side of the ring: a slot to build each batch in, then its handle."""

    def __init__(self, ring: SlotRing, worker: int) -> None:
        self.ring = ring
        self.worker = worker
        self._next = 0
        self._current: int | None = None
        self._specs: list[TensorSpec] = []
        self._sent = [ring.slots[worker][k] is not None for k in range(ring.per_worker)]

    def allocate(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Tensors for ``specs`` in the next free slot (waits for one; grows it if small)."""
        self.ring.free[self.worker].acquire()
        k = self._current = self._next
        self._next = (k + 1) % self.ring.per_worker
        self._specs = list(specs)
        size = layout(specs)[1]
        slots = self.ring.slots[self.worker]
        slot = slots[k]
        if slot is None or slot.numel() < size:
            size += size // 4  # batch sizes vary: room for a quarter more
            size = -(-size // _SLOT_GRANULE) * _SLOT_GRANULE
            storage = torch.UntypedStorage._new_shared(size)
            slot = slots[k] = torch.empty(0, dtype=torch.uint8).set_(storage)
            self.ring.versions[self.worker][k] += 1
            self._sent[k] = False
        return carve(slot, specs)

    def handle(self, batch: dict[str, Any], fp8_dtype: torch.dtype | None) -> SlotBatch:
        """The handle of ``batch`` (just built in the current slot) to send instead of it."""
        k = self._current
        if k is None:
            raise RuntimeError("handle() without allocate()")
        self._current = None
        names = {name for name, _, _ in self._specs}
        fields = {key: value for key, value in batch.items() if key not in names}
        storage = None if self._sent[k] else self.ring.slots[self.worker][k]
        self._sent[k] = True
        version = self.ring.versions[self.worker][k]
        return SlotBatch(self.worker, k, self._specs, fields, storage, version, fp8_dtype)


class SlotReceiver:
    """The training process's side: page-locks slots, copies them out, frees them.

    Args:
        ring: The ring the workers write (kept up to date with the slots they send,
            so later passes' workers reuse them).
        placement: How batches go to the device.
    """

    def __init__(self, ring: SlotRing, placement: Placement) -> None:
        self.ring = ring
        self.placement = placement
        self._locked: dict[tuple[int, int], _Locked] = {}
        self._copying: dict[int, tuple[int, torch.cuda.Event | None]] = {}

    def place(self, handle: SlotBatch) -> Placed:
        """The batch of ``handle`` on the device; the worker's previous slot is freed."""
        w, k = handle.worker, handle.slot
        if handle.storage is not None:
            self._adopt(w, k, handle.storage, handle.version)
        locked = self._locked.get((w, k))
        if locked is None:
            raise RuntimeError(f"worker {w} sent slot {k} before its buffer")
        batch: dict[str, Any] = carve(locked.slot, handle.specs)
        if not self.placement.cuda:  # the slot is reused: the loop gets a copy
            batch = {name: tensor.clone() for name, tensor in batch.items()}
        batch.update(handle.fields)
        placed = self.placement.place(batch, handle.fp8_dtype)
        self._free_previous(w)
        self._copying[w] = (k, placed.ready)
        return placed

    def end_pass(self) -> None:
        """Wait for the copies still reading slots (the next pass's workers reuse them)."""
        for _, event in self._copying.values():
            if event is not None:
                event.synchronize()
        self._copying.clear()

    def close(self) -> None:
        """Unlock every slot (the loader is going away)."""
        self.end_pass()
        self._locked.clear()

    def _free_previous(self, worker: int) -> None:
        previous = self._copying.pop(worker, None)
        if previous is None:
            return
        if previous[1] is not None:
            previous[1].synchronize()  # long done, as a rule: it was queued a batch ago
        self.ring.free[worker].release()

    def _adopt(self, worker: int, index: int, slot: torch.Tensor, version: int) -> None:
        """A slot the worker made: page-lock it and keep it for later passes."""
        self._locked.pop((worker, index), None)  # unlocks the buffer it replaces
        self._locked[(worker, index)] = _Locked(slot, self.placement.cuda)
        self.ring.slots[worker][index] = slot
        self.ring.versions[worker][index] = version


class _Locked:
    """A slot page-locked for CUDA copies, unlocked before its memory can be unmapped.

    It holds the slot, so the memory outlives the registration: a mapping freed while
    registered would make CUDA refuse whatever is mapped there next.
    """

    def __init__(self, slot: torch.Tensor, cuda: bool) -> None:
        self.slot = slot
        self.cuda = cuda
        if not cuda:
            return
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(slot.data_ptr(), slot.numel(), 0))
        if code != 0:
            cudart.cudaGetLastError()  # or torch reports it at the next kernel launch
            self.cuda = False
            raise RuntimeError(
                f"cudaHostRegister of a {slot.numel()}-byte batch slot failed (CUDA error "
                f"{code}); the host may limit locked memory (ulimit -l)"
            )

    def __del__(self) -> None:
        if self.cuda:
            with contextlib.suppress(Exception):  # at exit CUDA may be gone already
                torch.cuda.cudart().cudaHostUnregister(self.slot.data_ptr())
