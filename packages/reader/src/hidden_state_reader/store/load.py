"""Bytes read from the store -> a ``Sample``, through the same loader as files.

The bytes are the file the file backend would have written, so they go through the
format's own ``sample.load.load_buffer``: the header is validated the same way (a short
object is ``IncompleteSampleError``), and layer selection, dtype and device work as for
files. The tensors are views of the bytes (no copy).

The CRC32 is always checked, here, before any tensor is made (``check_bytes``, in the
read-ahead thread; ``load_checked`` makes the tensors in the caller's thread, where a
``device=`` copy is ordered on the caller's CUDA stream), with the fastest CRC-32
implementation this host has (``kernels.crc``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError
from hidden_state_reader.format.header import Meta, SampleHeader, header_length, parse_header
from hidden_state_reader.format.store_keys import CommitRecord
from hidden_state_reader.kernels import layouts
from hidden_state_reader.kernels.crc import Crc32, crc32
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.load import load_buffer
from hidden_state_reader.sample.sample import Sample


def check_bytes(
    where: str, data: np.ndarray, record: CommitRecord | None, crc: Crc32 = crc32
) -> None:
    """Check one sample's bytes as the store promises them: size and CRC32.

    The header is parsed (its structure rule: a short object is incomplete) to find the
    data section; ``load_checked`` then makes the tensors.

    Args:
        where: The sample's address, for errors.
        data: The object read from the store (``StoreClient.get_object``).
        record: Its commit record (size and CRC to match), when known.
        crc: The CRC32 function (default: the fastest found, ``kernels.crc``).

    Raises:
        IncompleteSampleError: Fewer bytes than the commit record or the header promise.
        CorruptSampleError: Malformed, a CRC32 mismatch, or no CRC32 recorded.
    """
    if record is not None and len(data) != record.size:
        cls = IncompleteSampleError if len(data) < record.size else CorruptSampleError
        raise cls(where, f"{len(data)} bytes stored, the commit record says {record.size}")
    header = _header(where, data)
    recorded = header.metadata.get(Meta.CRC32)
    if recorded is None:
        raise CorruptSampleError(where, "no crc32 in the header (store samples always carry one)")
    if record is not None and record.crc32 and record.crc32 != recorded:
        raise CorruptSampleError(
            where, f"header crc32 {recorded}, commit record says {record.crc32}"
        )
    actual = f"{crc(data[header.data_start :]) & 0xFFFFFFFF:08x}"
    if actual != recorded:
        raise CorruptSampleError(where, f"CRC32 mismatch: file says {recorded}, data is {actual}")


def load_checked(where: str, data: np.ndarray, options: LoadOptions) -> Sample:
    """Load the bytes ``check_bytes`` accepted: the sample's tensors view ``data``.

    The rest of the content rule (layer selection, fp8 dtype, mask bytes) and the
    options (layers, dtype, device) apply as for a file.

    Raises:
        CorruptSampleError: The options ask for what the sample does not have.
    """
    return load_buffer(where, data, dataclasses.replace(options, verify_checksum=False))


def _header(where: str, data: np.ndarray) -> SampleHeader:
    """The validated header of a whole sample held in ``data``."""
    length = header_length(where, data[:8].tobytes(), len(data))
    return parse_header(where, data[8 : 8 + length].tobytes(), len(data), layouts)
