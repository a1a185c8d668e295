"""zlib's CRC-32 (the ``crc32`` of a sample's header), from the fastest implementation here.

Every CRC-32 of the format goes through ``crc32``: the writer's (``files.publish``), a
check of a file (``verify_checksum=True``, ``verify --checksums``) and the store
reader's, which checks every sample. The standard library's ``zlib.crc32`` is slow next
to the same CRC-32 computed with carry-less multiplication by zlib-ng (``pip install
zlib-ng``), ISA-L (``pip install isal``), or the system's libdeflate (``libdeflate.so.0``,
present wherever libtiff is; called through ``ctypes``, which releases the GIL). The first
of these that loads is used, in that order, else ``zlib``'s; every one gives the same
value (``tests/reader/format/test_crc.py``). None is a declared dependency: each is an
optional speed-up (docs/dependencies.md says how fast each is).

Which one is chosen on first use, not at import (importing this module loads nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import zlib
from typing import Any, Protocol


class Crc32(Protocol):
    """A CRC-32 implementation: zlib's CRC-32 of a contiguous buffer."""

    def __call__(self, data: Any, value: int = 0, /) -> int:
        """The CRC-32 of ``data``, continuing from ``value`` (0 to start)."""


_MODULES = (("zlib_ng.zlib_ng", "crc32"), ("isal.isal_zlib", "crc32"))


def from_module(module: str, name: str) -> Crc32 | None:
    """``module.name`` (a ``zlib.crc32`` work-alike), None if absent."""
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None

    def crc(data: Any, value: int = 0, /) -> int:
        return int(function(data, value))

    return crc


def from_libdeflate() -> Crc32 | None:
    """The system's ``libdeflate_crc32`` through ``ctypes``, None if it cannot be loaded."""
    import numpy as np

    path = ctypes.util.find_library("deflate") or "libdeflate.so.0"
    try:
        function = ctypes.CDLL(path).libdeflate_crc32
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_uint32
    function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

    def crc(data: Any, value: int = 0, /) -> int:
        array = np.frombuffer(data, dtype=np.uint8)  # any contiguous buffer, no copy
        return int(function(value, array.ctypes.data, array.nbytes)) if array.nbytes else value

    return crc


def stdlib(data: Any, value: int = 0, /) -> int:
    """The standard library's ``zlib.crc32``."""
    return zlib.crc32(data, value)


def implementations() -> dict[str, Crc32]:
    """Every implementation this host has, fastest first (``zlib``, the stdlib's, last)."""
    found: dict[str, Crc32 | None] = {
        **{module: from_module(module, name) for module, name in _MODULES},
        "libdeflate": from_libdeflate(),
        "zlib": stdlib,
    }
    return {name: function for name, function in found.items() if function is not None}


@functools.cache
def chosen() -> tuple[str, Crc32]:
    """The implementation ``crc32`` uses, and its name (decided once per process)."""
    return next(iter(implementations().items()))


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 (zlib's) of ``data``, a contiguous buffer, continuing from ``value``.

    Args:
        data: bytes, a memoryview or a contiguous numpy array.
        value: The CRC-32 of what came before ``data`` (0 to start).
    """
    return chosen()[1](data, value)
