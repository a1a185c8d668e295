"""A fixed pool of host buffers ("slabs") that samples travel through on their way to disk.

The slabs are ``byte_buffer``s of the host-memory home (``kernels/host_memory.py`` of
the reader, which says why this pool stays its own).

Every slab holds one gather chunk. The pool allocates slabs lazily up to its byte
budget and then only reuses them, so host memory is bounded and, on CUDA, no pinned
memory is allocated per request (``cudaHostAlloc`` is slow, docs/connector.md; a reused
slab costs nothing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hidden_state_connector.logs import get_logger
from hidden_state_reader.kernels.host_memory import byte_buffer

log = get_logger(__name__)


@dataclass(eq=False)
class Slab:
    """One reusable host buffer.

    Attributes:
        index: Position in the pool.
        data: ``uint8`` tensor of the slab's size.
        event: CUDA event recorded after the device-to-host copy into it (None on CPU).
    """

    index: int
    data: torch.Tensor
    event: Any = None
    nonfinite: torch.Tensor | None = field(default=None)


class SlabPool:
    """Bounded, thread-safe pool of equally sized host buffers.

    Args:
        slab_bytes: Size of each slab.
        budget_bytes: Total host memory the pool may hold.
        pinned: Allocate page-locked memory (for asynchronous device-to-host copies).
    """

    def __init__(self, slab_bytes: int, budget_bytes: int, *, pinned: bool) -> None:
        if slab_bytes <= 0:
            raise ValueError("slab_bytes must be positive")
        if slab_bytes > budget_bytes:
            log.warning(
                "one chunk (%d bytes) exceeds host_buffer_bytes (%d); using one slab",
                slab_bytes,
                budget_bytes,
            )
        self.slab_bytes = slab_bytes
        self.capacity = max(1, budget_bytes // slab_bytes)
        self.pinned = pinned
        self._free: list[Slab] = []
        self._allocated = 0
        self._lock = threading.Lock()

    @property
    def allocated_bytes(self) -> int:
        """Host memory held by the pool so far (its high-water mark)."""
        return self._allocated * self.slab_bytes

    @property
    def in_use(self) -> int:
        """Slabs currently lent out."""
        with self._lock:
            return self._allocated - len(self._free)

    def idle_slabs(self) -> list[Slab]:
        """The slabs allocated and not lent out now (a snapshot)."""
        with self._lock:
            return list(self._free)

    def preallocate(self) -> None:
        """Allocate every slab now, so no step ever pays for an allocation.

        Pinned allocations cost milliseconds each (``cudaHostAlloc``); doing them at
        start-up keeps them off the engine's critical path.
        """
        with self._lock:
            first, self._allocated = self._allocated, self.capacity
        for index in range(first, self.capacity):
            slab = Slab(index, byte_buffer(self.slab_bytes, pin=self.pinned))
            with self._lock:
                self._free.append(slab)

    def try_acquire(self) -> Slab | None:
        """A free slab, allocating one if under budget; None when all are lent out."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated >= self.capacity:
                return None
            index = self._allocated
            self._allocated += 1
        data = byte_buffer(self.slab_bytes, pin=self.pinned)
        return Slab(index, data)

    def release(self, slab: Slab) -> None:
        """Give a slab back."""
        with self._lock:
            self._free.append(slab)
