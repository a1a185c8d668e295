"""Host memory, the project's one home of it: huge-page-advised, recycled when unused.

Every host-memory pool is built of the two kinds given here: ``huge_mapping``
(anonymous, ``MADV_HUGEPAGE``) and ``byte_buffer`` (uint8, page-locked for CUDA when
asked), and every page-locked tensor comes from here (``byte_buffer``, ``empty(...,
pin_memory=True)``; ``tests/test_architecture_rules.py`` keeps it so). The pools stay
apart because they reuse memory on different signals (listed in docs/reader.md, "Host
memory"): this module's cache, the store's receive arena, the device feed's batch
buffers, the connector's slab pool and forward capture's arena and transfer ring.

This module's cache exists because a tensor written into fresh memory pays one page
fault per 4 KiB page, slower than dequantizing fp8 into it (docs/reader.md, "How do I
read fp8 samples?"). Mappings are kept per process (``CACHE_BYTES`` in all, in
power-of-two size classes) and handed out again once no tensor views them, so a reader
making one sample after another writes into pages already there. Huge pages mean fewer
TLB misses; with no free 2 MiB page at hand the kernel compacts memory on the first
fault, once per buffer.

A mapping is known to be unused when nothing but the cache refers to it: every tensor
made from it (``torch.frombuffer``) holds a reference through its storage, views and
numpy arrays of it too, so memory is never reused while anything can still read it.
"""

from __future__ import annotations

import mmap
import sys
import threading
from contextlib import suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

HUGE_PAGE = 2 << 20
"""Buffers of at least this many bytes come from the cache (smaller ones: torch's allocator)."""
CACHE_BYTES = 512 << 20
"""Most bytes of mappings a process keeps for reuse (in use or idle); larger ones are not kept."""


def empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones in recycled huge-page-advised memory.

    The tensor keeps its mapping alive (it returns to the cache, or is unmapped, with the
    last tensor using it). Pinned memory comes from torch's pinned allocator (which
    caches its blocks).

    Args:
        shape: The tensor's shape.
        dtype: Its dtype.
        pin_memory: Page-locked memory instead (needs CUDA).
    """
    import torch

    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if pin_memory or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    mapping = _CACHE.take(nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def byte_buffer(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` for a pool to own: page-locked when ``pin`` (CUDA).

    Not recycled here: the pool that asks for it decides when it is reused. A large
    unpinned one is a mapping of its own, given back to the system with its last tensor
    (from malloc's heap, a pool's freed slabs could stay reserved by the process).
    """
    import torch

    if pin or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return torch.frombuffer(huge_mapping(nbytes), dtype=torch.uint8, count=nbytes)


def empty_bytes(nbytes: int) -> np.ndarray:
    """``empty((nbytes,), torch.uint8)`` as a numpy array (it keeps the memory alive)."""
    import torch

    return empty((nbytes,), torch.uint8).numpy()


def _size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (untouched pages of a mapping cost nothing)."""
    return 1 << max(nbytes - 1, 1).bit_length()


def huge_mapping(size: int) -> mmap.mmap:
    """Anonymous private memory of ``size`` bytes, advised ``MADV_HUGEPAGE``.

    Faulted in on first touch; where the advice is refused (an old kernel, THP compiled
    out) the pages are ordinary ones.
    """
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):  # refused (an old kernel, THP compiled out): ordinary pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


class _MappingCache:
    """Anonymous mappings by size class, reused once only the cache refers to them."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._classes: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """A mapping of at least ``nbytes`` that no tensor uses (a kept one if possible)."""
        size = _size_class(nbytes)
        with self._lock:
            kept = self._classes.setdefault(size, [])
            for i in range(len(kept)):
                if sys.getrefcount(kept[i]) == 2:  # the list and this call: nothing else
                    return kept[i]
            if self._bytes + size > self._limit:
                self._drop_unused()
            mapping = huge_mapping(size)
            if self._bytes + size <= self._limit:
                kept.append(mapping)
                self._bytes += size
            return mapping

    def _drop_unused(self) -> None:
        """Forget the mappings no tensor uses (each is unmapped as it is dropped)."""
        for size, kept in self._classes.items():
            # Counted as ``take`` counts (the list and the call's argument), with no loop
            # variable holding one more (or, on newer Pythons, a borrowed one less).
            busy = [kept[i] for i in range(len(kept)) if sys.getrefcount(kept[i]) > 2]
            self._bytes -= size * (len(kept) - len(busy))
            kept[:] = busy


_CACHE = _MappingCache(CACHE_BYTES)
