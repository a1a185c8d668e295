"""Every CRC-32 implementation the format may pick computes zlib's CRC-32.

Only the implementations this host has are compared (``zlib`` always).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hidden_state_reader.kernels.crc import chosen, crc32, implementations, stdlib


@pytest.mark.parametrize("name", list(implementations()))
def test_each_implementation_computes_zlibs_crc32(name: str) -> None:
    function = implementations()[name]
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    for start, end in [(0, 0), (0, 1), (3, 10), (1, 4099), (5, len(data))]:
        part = data[start:end]  # odd lengths, and starts off any alignment
        assert function(part, 0) == zlib.crc32(part.tobytes()), (name, start, end)
    # continued over pieces of any kind of buffer, as the writer and the checks do
    pieces = [data[:7], memoryview(data[7:5000].tobytes()), data[5000:].tobytes()]
    value = 0
    for piece in pieces:
        value = function(piece, value)
    assert value == zlib.crc32(data.tobytes()), name


def test_the_fastest_implementation_found_is_used() -> None:
    found = implementations()
    assert list(found.values())[-1] is stdlib and next(iter(found)) == chosen()[0]
    assert crc32(b"hidden states", 0) == zlib.crc32(b"hidden states")
