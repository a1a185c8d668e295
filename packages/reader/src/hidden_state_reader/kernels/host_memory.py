"""Host memory for large tensors: huge-page-advised, and recycled once no tensor uses it.

A tensor written into fresh memory pays for its pages the first time it is touched: one
page fault per 4 KiB page, slower than dequantizing fp8 into it (figures: docs/reader.md,
"How do I read fp8 samples?"). So:

* mappings are kept in a small per-process cache (``CACHE_BYTES`` in all, in
  power-of-two size classes) and handed out again once no tensor views them any more:
  a reader that makes one sample after another writes into pages that are already
  there, and pays for fresh pages once per buffer, not once per sample;
* they are advised with ``MADV_HUGEPAGE`` (Linux's default transparent-huge-page mode,
  ``madvise``, honours it; elsewhere it is ignored): results in 2 MiB pages are written
  and read with fewer TLB misses. The price is paid once per buffer: with no free 2 MiB
  page at hand the kernel compacts memory on the first fault.

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


def empty_bytes(nbytes: int) -> np.ndarray:
    """``empty((nbytes,), torch.uint8)`` as a numpy array (it keeps the memory alive)."""
    import torch

    return empty((nbytes,), torch.uint8).numpy()


def _size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (untouched pages of a mapping cost nothing)."""
    return 1 << max(nbytes - 1, 1).bit_length()


def _new_mapping(size: int) -> mmap.mmap:
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
            mapping = _new_mapping(size)
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
