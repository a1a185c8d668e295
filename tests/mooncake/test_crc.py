"""Every CRC-32 implementation the store reader may pick computes zlib's CRC-32.

No store needed. Only the implementations this host has are compared (``zlib`` always).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hidden_state_reader.store.crc import CRC32_NAME, implementations, stdlib


@pytest.mark.parametrize("name", list(implementations()))
def test_each_implementation_computes_zlibs_crc32(name: str) -> None:
    function = implementations()[name]
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    for start, end in [(0, 0), (0, 1), (3, 10), (1, 4099), (5, len(data))]:
        part = data[start:end]  # odd lengths, and starts off any alignment
        assert function(part) == zlib.crc32(part.tobytes()), (name, start, end)


def test_the_reader_uses_the_fastest_implementation_found() -> None:
    found = implementations()
    assert list(found.values())[-1] is stdlib and next(iter(found)) == CRC32_NAME
