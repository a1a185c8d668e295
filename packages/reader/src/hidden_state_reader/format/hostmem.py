"""Fresh host memory for large tensors, backed by transparent huge pages where allowed.

A tensor written into fresh memory pays one page fault per 4 KiB page the first time it
is touched; on the benchmark machine (a VM) that alone limits filling a new 32 MiB
tensor to 2-4 GB/s, slower than dequantizing into it. Anonymous memory advised with
``MADV_HUGEPAGE`` faults in 2 MiB at a time (measured up to 28 GB/s there). Linux's
default transparent-huge-page mode (``madvise``) honours the advice; elsewhere it is
ignored and the memory is ordinary.
"""

from __future__ import annotations

import mmap
from contextlib import suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

HUGE_PAGE = 2 << 20
"""Buffers of at least this many bytes are advised to use huge pages."""


def empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones in huge-page-advised anonymous memory.

    The tensor keeps its mapping alive (it is unmapped with the last tensor using it).
    Pinned memory comes from torch's pinned allocator (which caches its blocks).

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
    if pin_memory or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with suppress(OSError):  # advice refused (an old kernel, THP compiled out): ordinary pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def empty_bytes(nbytes: int) -> np.ndarray:
    """``empty((nbytes,), torch.uint8)`` as a numpy array (it keeps the memory alive)."""
    import torch

    return empty((nbytes,), torch.uint8).numpy()
