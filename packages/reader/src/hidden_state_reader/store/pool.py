"""Receive memory for samples: one registered arena, lent out per sample, back when its tensors go.

A sample read from the store lands with ``get_into`` in memory registered with the
transfer engine, and its tensors view that memory (no copy). Registering costs (RDMA pins
the pages) and fresh memory costs page faults while the transfer writes it
(docs/scale-out.md, "How a reader reads a sample"), so a reader registers one arena,
once, and lends ranges of it.

A range is lent as a ``_Lease``: a tiny object that exports the range to numpy
(``__array_interface__``). numpy keeps it as the ``base`` of the array and of every view
of that array, and ``torch.from_numpy`` keeps the array alive for as long as any tensor
uses its storage, so the lease dies exactly when the last array or tensor over the range
is gone, and only then does the range go back to the arena: a range is never reused
while anything still views it. A sample kept forever keeps its range forever; when the
arena has no room, ``lend`` says so and the caller uses fresh memory instead, so the
arena's size is the bound on what this module holds.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any

import numpy as np

from hidden_state_reader.kernels.host_memory import huge_mapping

ALIGN = 4096  # ranges start on page boundaries (every tensor view is aligned)


class _Lease:
    """The owner of one lent range: the ``base`` of every array over it.

    Dropped by the last view; its finaliser hands the range back. ``__del__`` only
    appends to a deque (thread-safe, takes no lock): it can run in any thread, inside
    the garbage collector, even while that thread holds the pool's lock.
    """

    def __init__(self, arena: np.ndarray, start: int, nbytes: int, returned: Any) -> None:
        self.__array_interface__ = {
            "data": (arena.ctypes.data + start, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        self._arena = arena  # the mapping outlives every lease over it
        self._range = (start, -(-nbytes // ALIGN) * ALIGN)
        self._returned = returned

    def __del__(self) -> None:
        self._returned.append(self._range)


class ReceivePool:
    """An arena of ``capacity`` bytes lent out in sample-sized ranges (first fit).

    Args:
        capacity: Bytes of the arena (anonymous memory, huge-page-advised, faulted in
            on first use).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = -(-capacity // ALIGN) * ALIGN
        self.arena = np.frombuffer(huge_mapping(self.capacity), dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (start, length), sorted
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        self.lent = 0  # ranges lent and not yet back (for tests and benchmarks)
        self.misses = 0  # requests the arena had no room for

    @property
    def address(self) -> int:
        """Where the arena starts (to register it with the transfer engine)."""
        return int(self.arena.ctypes.data)

    def lend(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of the arena as a ``uint8`` array of its own, None if there is no room.

        The range comes back when the array and everything viewing it are gone.
        """
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            self._take_back()
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    self.lent += 1
                    break
            else:
                self.misses += 1
                return None
        return np.asarray(_Lease(self.arena, start, nbytes, self._returned))

    def in_use(self) -> int:
        """Ranges still lent out (after taking back those whose views are gone)."""
        with self._lock:
            self._take_back()
            return self.lent

    def _take_back(self) -> None:
        """Merge the ranges whose leases died into the free list (lock held)."""
        while self._returned:
            start, length = self._returned.popleft()
            self.lent -= 1
            free = self._free
            lo = bisect.bisect_left(free, (start, 0))
            free.insert(lo, (start, length))
            if lo + 1 < len(free) and start + length == free[lo + 1][0]:  # merge right
                free[lo] = (start, length + free.pop(lo + 1)[1])
            if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == start:  # merge left
                prev = free.pop(lo - 1)
                free[lo - 1] = (prev[0], prev[1] + free[lo - 1][1])
