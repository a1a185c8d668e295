"""The content rule: what the loader refuses in a file whose header is valid.

``parse_header`` (``format/header.py``) proves everything the header can: tensors, shapes,
dtypes, offsets, completeness. What is left, and what the loader refuses, is decided
here, in one place, for both sides of every count:

* the loader (``load.load_fd``) checks the bytes it has just read;
* ``health.check_sample`` (behind ``ls``, ``stats``, ``verify``, ``inspect`` and
  ``len(HiddenStateDataset)``) checks the file without loading its tensors, reading only
  what a verdict needs (``examine``).

So a count says "ready" exactly when the reader would yield the file. The checks, in
the order the loader meets them:

1. with ``verify_checksum``: the writer's CRC32, when recorded (reads all tensor bytes);
2. the layer selection (``layers`` / ``layer_ids``) exists in the file;
3. an fp8 file that is dequantized on read names a dtype to dequantize to that this
   format knows (``model_dtype`` metadata);
4. every ``loss_mask`` byte is 0 or 1 (reads one byte per token, only for files with a
   mask).

Needs no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError, SampleError
from hidden_state_reader.files.header import read_header_fd
from hidden_state_reader.format import fp8
from hidden_state_reader.format.header import Meta, SampleHeader
from hidden_state_reader.format.loss_mask import LOSS_MASK, check_mask_values
from hidden_state_reader.kernels.crc import crc32
from hidden_state_reader.options import LoadOptions

DataReader = Callable[[int, int], "bytes | memoryview"]
"""``read(begin, end)``: bytes ``[begin, end)`` of a file's data section."""

_CRC_CHUNK = 16 << 20  # bytes per CRC step when reading a file: bounded memory


def check_content(header: SampleHeader, options: LoadOptions, read: DataReader) -> list[int] | None:
    """Raise what the loader would raise about a file whose header parsed.

    Args:
        header: The validated header.
        options: How the file is to be loaded (the checks depend on them).
        read: Where the data section's bytes come from (the loader's buffer, or the file).

    Returns:
        The layer positions the options select (``layer_positions``), for the loader.

    Raises:
        CorruptSampleError: The loader refuses the file; the message names it and says
            why.
        IncompleteSampleError: The file shrank while it was being read.
    """
    path = header.path
    if options.verify_checksum:
        check_crc32(header, read)
    positions = (
        None
        if options.layers is None and options.layer_ids is None
        else layer_positions(header, options)
    )
    tensors = header.tensors
    if fp8.SCALES in tensors and not options.raw_fp8 and options.dtype is None:
        fp8.check_model_dtype(header.metadata.get(Meta.MODEL_DTYPE), path)
    mask = tensors.get(LOSS_MASK)
    if mask is not None:
        check_mask_values(read(mask.begin, mask.end), path)
    return positions


def check_crc32(header: SampleHeader, read: DataReader) -> None:
    """The data section matches the writer's CRC32, if one is recorded.

    Raises:
        CorruptSampleError: It does not.
    """
    expected = header.metadata.get(Meta.CRC32)
    if expected is None:
        return
    crc, total = 0, header.data_bytes
    for begin in range(0, total, _CRC_CHUNK):
        crc = crc32(read(begin, min(begin + _CRC_CHUNK, total)), crc)
    actual = f"{crc & 0xFFFFFFFF:08x}"
    if actual != expected:
        raise CorruptSampleError(
            header.path, f"CRC32 mismatch: file says {expected}, data is {actual}"
        )


def layer_positions(header: SampleHeader, options: LoadOptions) -> list[int] | None:
    """Positions on the layer axis that ``options`` select (None: all of them).

    Raises:
        CorruptSampleError: The selection does not exist in this file.
    """
    if options.layers is not None:
        n = header.num_layers
        positions = []
        for p in options.layers:
            if not -n <= p < n:
                raise CorruptSampleError(
                    header.path, f"layer position {p} out of range for {n} captured layers"
                )
            positions.append(p % n)
        return positions
    if options.layer_ids is not None:
        ids = header.layer_ids
        if ids is None:
            raise CorruptSampleError(
                header.path, "no layer_ids metadata; select layers by position instead"
            )
        try:
            return [ids.index(i) for i in options.layer_ids]
        except ValueError as exc:
            raise CorruptSampleError(
                header.path, f"requested layer ids {list(options.layer_ids)}, file has {ids}"
            ) from exc
    return None


def file_reader(fd: int, header: SampleHeader) -> DataReader:
    """A ``DataReader`` that reads an open sample file (``pread``, no buffer kept)."""

    def read(begin: int, end: int) -> bytes:
        raw = os.pread(fd, end - begin, header.data_start + begin)
        if len(raw) < end - begin:
            raise IncompleteSampleError(header.path, "file shrank while it was being read")
        return raw

    return read


def examine(
    fd: int, path: str, options: LoadOptions
) -> tuple[SampleHeader | None, SampleError | None]:
    """What the loader would say about an open sample file, without loading its tensors.

    Reads the header and then only what ``check_content`` needs: nothing more for most
    files, one byte per token for a file with a ``loss_mask``, everything with
    ``verify_checksum``.

    Returns:
        ``(header, problem)``: the header when it parses (also when the content is
        refused), and the error the loader would raise (None: it would load the file).

    Raises:
        OSError: The file cannot be read.
    """
    try:
        header = read_header_fd(fd, path)
    except (CorruptSampleError, IncompleteSampleError) as exc:
        return None, exc
    try:
        check_content(header, options, file_reader(fd, header))
    except (CorruptSampleError, IncompleteSampleError) as exc:
        return header, exc
    return header, None


__all__ = [
    "DataReader",
    "check_content",
    "check_crc32",
    "examine",
    "file_reader",
    "layer_positions",
]
