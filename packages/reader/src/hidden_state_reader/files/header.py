"""Reading a sample's header from its file: the format's rule (``format.header``) on disk.

Two small reads (the 8-byte length, then the JSON header); the validation is the
format's, with the process's memo of tensor layouts already validated (``kernels.layouts``).
"""

from __future__ import annotations

import os

from hidden_state_reader.files.fileio import open_sample
from hidden_state_reader.format.header import SampleHeader, header_length, parse_header
from hidden_state_reader.kernels import layouts


def read_header_fd(fd: int, path: str, file_size: int | None = None) -> SampleHeader:
    """Read and validate the header of an open sample file (``file_size``: from fstat)."""
    if file_size is None:
        file_size = os.fstat(fd).st_size
    length = header_length(path, os.pread(fd, 8, 0) if file_size else b"", file_size)
    return parse_header(path, os.pread(fd, length, 8), file_size, layouts)


def read_header(path: str | os.PathLike[str]) -> SampleHeader:
    """Read and validate the header of a sample file without loading its tensors.

    This is how lengths for length-aware batching are read: a few hundred bytes per file.

    Raises:
        IncompleteSampleError, CorruptSampleError: The file is unusable; the message
            names it and says why.
        OSError: The file cannot be opened.
    """
    path = os.fspath(path)
    with open_sample(path) as fd:
        return read_header_fd(fd, path)
