"""Bytes read from the store -> a ``Sample``, through the same loader as files.

The bytes are the file the file backend would have written, so they go through the
format's own ``sample.load.load_buffer``: the header is validated the same way (a short
object is ``IncompleteSampleError``), the CRC32 is always checked, and layer selection,
dtype and device work as for files. The tensors are views of the bytes (no copy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError
from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.store_keys import CommitRecord
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.load import load_buffer
from hidden_state_reader.sample.sample import Sample


def load_bytes(
    where: str, data: bytes | np.ndarray, record: CommitRecord | None, options: LoadOptions
) -> Sample:
    """Validate and load one sample's bytes.

    Args:
        where: The sample's address, for errors and ``Sample.path``.
        data: The object read from the store (``StoreClient.get_object``); its memory
            becomes the sample's.
        record: Its commit record (size and CRC to match), when known.
        options: Layer selection, dtype, pinning.

    Raises:
        IncompleteSampleError: Fewer bytes than the commit record or the header promise.
        CorruptSampleError: Malformed, a CRC32 mismatch, or no CRC32 recorded.
    """
    if record is not None and len(data) != record.size:
        cls = IncompleteSampleError if len(data) < record.size else CorruptSampleError
        raise cls(where, f"{len(data)} bytes stored, the commit record says {record.size}")
    file = data if isinstance(data, np.ndarray) else np.frombuffer(bytearray(data), np.uint8)
    sample = load_buffer(where, file, dataclasses.replace(options, verify_checksum=True))
    crc = sample.metadata.get(Meta.CRC32)
    if crc is None:
        raise CorruptSampleError(where, "no crc32 in the header (store samples always carry one)")
    if record is not None and record.crc32 and record.crc32 != crc:
        raise CorruptSampleError(where, f"header crc32 {crc}, commit record says {record.crc32}")
    return sample
