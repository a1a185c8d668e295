"""Load a complete sample file into tensors: one read, zero-copy views, validation.

A small file (under ``MMAP_MIN_BYTES``) is read whole, length prefix, header and data,
with a single ``preadv`` into one byte buffer (pinned if asked); a large one has its
header read and its data mapped (or read with one ``preadv``). Every tensor is a view
into that buffer; layer selection, the move to ``LoadOptions.device`` and the finishing
(dequantization, dtype conversion: ``finishing.py``) happen after. The header is
validated before any tensor is made (``hidden_state_reader.format.header``), so a
truncated or malformed file raises a typed error naming it instead of yielding garbage.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError
from hidden_state_reader.files.fileio import open_sample
from hidden_state_reader.files.header import read_header_fd
from hidden_state_reader.format import fp8
from hidden_state_reader.format.header import (
    HIDDEN_STATES,
    TOKEN_IDS,
    Meta,
    SampleHeader,
    TensorInfo,
    header_length,
    parse_header,
)
from hidden_state_reader.format.loss_mask import LOSS_MASK, loss_mask_view
from hidden_state_reader.format.tensors import dtype_tables
from hidden_state_reader.kernels import layouts
from hidden_state_reader.kernels.host_memory import byte_buffer
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.content import check_content
from hidden_state_reader.sample.finishing import finish_hidden_states
from hidden_state_reader.sample.placement import to_device
from hidden_state_reader.sample.sample import Sample

MMAP_MIN_BYTES = 1 << 20
# numpy has no bfloat16 or float8: tensors are viewed through the integer of their width.
_SAME_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# Per safetensors dtype name: the torch dtype, the numpy dtype of its width, and whether
# ``from_numpy`` of that numpy dtype already gives the torch dtype (no ``view`` needed).
_DTYPES = {
    name: (
        dtype,
        np.dtype(_SAME_WIDTH[dtype.itemsize]),
        dtype in (torch.int64, torch.int32, torch.uint8),
    )
    for name, dtype in dtype_tables()[0].items()
}


def _read_exact(fd: int, into: np.ndarray, offset: int, path: str) -> None:
    """Fill ``into`` (bytes) from ``offset`` of the file."""
    view = into.data
    n = os.preadv(fd, [view], offset)  # one call reads a whole small file
    done = n
    while done < len(view):
        if n == 0:
            raise IncompleteSampleError(path, "file shrank while it was being read")
        n = os.preadv(fd, [view[done:]], offset + done)
        done += n


def _view(file: np.ndarray, data_start: int, info: TensorInfo, path: str) -> torch.Tensor:
    """Tensor ``info`` as a view of the file's bytes (``file`` holds the whole file).

    Made through numpy: one array over the buffer and one ``from_numpy`` cost a third of
    the torch slicing and viewing calls, which matters for files of a few hundred KiB.
    """
    dtype, width, native = _DTYPES[info.dtype]
    start = data_start + info.begin
    if info.begin == info.end:
        return torch.empty(info.shape, dtype=dtype)
    try:
        if start % width.itemsize:  # misaligned in a foreign file: copy so the view is aligned
            raw = file[start : start + info.end - info.begin].copy()
            array = raw.view(width).reshape(info.shape)
        else:
            array = np.ndarray(info.shape, width, file, start)
    except (TypeError, ValueError) as exc:
        raise CorruptSampleError(path, f"cannot view tensor data: {exc}") from exc
    return torch.from_numpy(array) if native else torch.from_numpy(array).view(dtype)


def _large_file(fd: int, header: SampleHeader, options: LoadOptions, path: str) -> np.ndarray:
    """A large file's bytes: mapped, else its data section read with one call.

    A mapping avoids copying into fresh memory, whose page faults dominate reading large
    files from the page cache (docs/reader.md). It is private
    (copy-on-write), so the tensors are writable and never change the file, and it stays
    valid after the file is deleted. But pages not yet touched are read from the file
    later: a file rewritten in place would change (or, shortened, crash with SIGBUS) a
    sample already yielded. So only files of this project's writers are mapped: they
    carry ``format_version`` and are published by rename, never rewritten in place.
    Files of other writers (vLLM's example connector) are copied (the header's bytes of
    the buffer are left unread).
    """
    if options.mmap and not options.pin_memory and Meta.FORMAT in header.metadata:
        mapping = mmap.mmap(fd, header.file_size, flags=mmap.MAP_PRIVATE)
        return np.frombuffer(mapping, dtype=np.uint8)
    file = _empty(header.file_size, options)
    _read_exact(fd, file[header.data_start :], header.data_start, path)
    return file


def _empty(nbytes: int, options: LoadOptions) -> np.ndarray:
    if options.pin_memory:
        return byte_buffer(nbytes, pin=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)


def _read_file(
    fd: int, path: str, options: LoadOptions, file_size: int | None = None
) -> tuple[SampleHeader, np.ndarray]:
    """The validated header and the bytes of an open file (header bytes included).

    Small files take one read for everything: the per-file cost of a sample of a few
    hundred KiB is its system calls and Python calls, not its bytes.
    """
    if file_size is None:
        file_size = os.fstat(fd).st_size
    if file_size >= MMAP_MIN_BYTES:
        header = read_header_fd(fd, path, file_size)
        return header, _large_file(fd, header, options, path)
    file = _empty(file_size, options) if options.pin_memory else np.empty(file_size, np.uint8)
    if file_size:
        _read_exact(fd, file, 0, path)  # one preadv, as a rule
    return _parse(path, file), file


def _parse(path: str, file: np.ndarray) -> SampleHeader:
    """The validated header of a whole file held in ``file``."""
    view = file.data
    length = header_length(path, view, len(view))
    return parse_header(path, view[8 : 8 + length].tobytes(), len(view), layouts)


def load_buffer(path: str, file: np.ndarray, options: LoadOptions | None = None) -> Sample:
    """Load a sample from a whole file's bytes in memory (e.g. a store object).

    The tensors are views of ``file`` (which must not be reused afterwards), validated
    as ``load_sample`` validates a file.

    Args:
        path: Where the bytes came from, for errors and ``Sample.path``.
        file: The file's bytes, ``uint8``.
        options: As for ``load_sample``.
    """
    options = options or LoadOptions()
    return _sample(_parse(path, file), file, path, options)


def load_fd(
    fd: int, path: str, options: LoadOptions | None = None, file_size: int | None = None
) -> Sample:
    """Load a sample from an open file descriptor (see ``load_sample``).

    Args:
        fd: The open sample file.
        path: Its path, for errors and ``Sample.path``.
        options: As for ``load_sample``.
        file_size: Its size, when the caller has just taken it (``os.fstat``).
    """
    options = options or LoadOptions()
    header, file = _read_file(fd, path, options, file_size)
    return _sample(header, file, path, options)


def load_published(
    fd: int, path: str, options: LoadOptions, file_size: int | None = None
) -> Sample | None:
    """``load_fd``, for a file of this project's writers only (None for any other).

    Files of our writers record ``format_version`` and are published by rename
    (``files/publish.py``). Raises as ``load_fd`` does.
    """
    header, file = _read_file(fd, path, options, file_size)
    if Meta.FORMAT not in header.metadata:
        return None
    return _sample(header, file, path, options)


def _sample(header: SampleHeader, file: np.ndarray, path: str, options: LoadOptions) -> Sample:
    """The sample made of a validated header and the file's bytes."""
    start = header.data_start
    tensors = header.tensors
    # The one content rule (CRC, layer selection, fp8 target dtype, mask bytes): the
    # listing commands apply the same function to the file, so they count what loads.
    positions = check_content(
        header, options, lambda begin, end: file[start + begin : start + end].data
    )
    token_ids = _view(file, start, tensors[TOKEN_IDS], path)
    if token_ids.dtype is not torch.int64:
        token_ids = token_ids.to(torch.int64)
    hidden = _view(file, start, tensors[HIDDEN_STATES], path)
    if (
        len(tensors) == 2
        and positions is None
        and options.device is None
        and (options.dtype is None or hidden.dtype is options.dtype)
    ):
        # The plain sample (no scales, no mask, as stored): what follows changes nothing.
        return Sample(token_ids, hidden, path, header.metadata, header.layer_ids)
    scales_info = tensors.get(fp8.SCALES)
    scales = None if scales_info is None else _view(file, start, scales_info, path)
    layer_ids = header.layer_ids
    if positions is not None:
        hidden = hidden[:, positions]
        if scales is not None and scales.shape[1] != 1:  # per-layer scales follow their rows
            scales = scales[:, positions]
        if layer_ids is not None:
            layer_ids = [layer_ids[p] for p in positions]
    mask_info = tensors.get(LOSS_MASK)
    loss_mask = None
    if mask_info is not None:  # a bool view of the stored bytes; layer/dtype options do not apply
        raw = file[start + mask_info.begin : start + mask_info.end]
        loss_mask = loss_mask_view(torch.from_numpy(raw))
    if options.device is not None:  # moved as stored: fp8 is half the bytes of bf16
        token_ids, hidden = to_device(token_ids, options.device), to_device(hidden, options.device)
        scales = None if scales is None else to_device(scales, options.device)
        loss_mask = None if loss_mask is None else to_device(loss_mask, options.device)
    hidden, scales = finish_hidden_states(
        hidden,
        scales,
        raw_fp8=options.raw_fp8,
        dtype=options.dtype,
        writers=[(header.metadata, path)],
        pin_memory=options.pin_memory and options.device is None,
    )
    return Sample(
        token_ids,
        hidden,
        path,
        header.metadata,
        layer_ids,
        loss_mask=loss_mask,
        hidden_states_scales=scales,
    )


def load_sample(path: str | os.PathLike[str], options: LoadOptions | None = None) -> Sample:
    """Load one sample file, validating it completely first.

    This does not look at the lock; use ``HiddenStateReader`` (or ``SharedLock``) for
    files that may still be being written.

    Args:
        path: A ``.safetensors`` sample file.
        options: Layer selection, dtype, pinning, checksum verification.

    Returns:
        The sample.

    Raises:
        IncompleteSampleError, CorruptSampleError: The file is unusable (named).
        OSError: It cannot be opened.
    """
    path = os.fspath(path)
    with open_sample(path) as fd:
        return load_fd(fd, path, options)
