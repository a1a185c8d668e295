"""zlib's CRC-32 of a sample's bytes, from the fastest implementation this host has.

The store reader checks every sample's CRC32, and at the store's transfer rate the
standard library's ``zlib.crc32`` (about 4 GB/s on the benchmark machine: a third of a
32 MiB sample's read time) is what limits a reader. The same CRC-32 is computed with
carry-less multiplication by zlib-ng (``pip install zlib-ng``: 30-40 GB/s there), ISA-L
(``pip install isal``: about 30 GB/s), or the system's libdeflate (``libdeflate.so.0``,
present wherever libtiff is; called through ``ctypes``, which releases the GIL: about
14 GB/s). ``crc32`` is the first of these that loads, in that order, else ``zlib``'s.
Every one gives the same value (``tests/mooncake/test_crc.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import zlib
from collections.abc import Callable

import numpy as np

Crc32 = Callable[[np.ndarray], int]
"""``crc32(data) -> int``: zlib's CRC-32 of a contiguous ``uint8`` array."""

_MODULES = (("zlib_ng.zlib_ng", "crc32"), ("isal.isal_zlib", "crc32"))


def from_module(module: str, name: str) -> Crc32 | None:
    """``module.name`` (a ``zlib.crc32`` work-alike) as a ``Crc32``, None if absent."""
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return lambda data: int(function(data.data))


def from_libdeflate() -> Crc32 | None:
    """The system's ``libdeflate_crc32`` through ``ctypes``, None if it cannot be loaded."""
    path = ctypes.util.find_library("deflate") or "libdeflate.so.0"
    try:
        function = ctypes.CDLL(path).libdeflate_crc32
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_uint32
    function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return lambda data: int(function(0, data.ctypes.data, data.nbytes)) if data.nbytes else 0


def stdlib(data: np.ndarray) -> int:
    """The standard library's ``zlib.crc32``."""
    return zlib.crc32(data.data)


def implementations() -> dict[str, Crc32]:
    """Every implementation this host has, fastest first (``stdlib`` last)."""
    found: dict[str, Crc32 | None] = {
        **{module: from_module(module, name) for module, name in _MODULES},
        "libdeflate": from_libdeflate(),
        "zlib": stdlib,
    }
    return {name: function for name, function in found.items() if function is not None}


CRC32_NAME, crc32 = next(iter(implementations().items()))
"""The implementation ``store.load`` checks samples with, and its name."""
