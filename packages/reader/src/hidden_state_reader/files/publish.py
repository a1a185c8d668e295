"""Atomic publication of one sample: temp file, ``os.replace``, then release the lock.

``SampleFileWriter`` streams a sample to ``NAME.safetensors.tmp.<unique>`` (the header
and ``token_ids`` first, then ``hidden_states`` in as many chunks as the caller likes,
then the optional ``loss_mask``), patches the fixed-width metadata that is only known
at the end (CRC32, non-finite flag), optionally fsyncs, renames the file to its final
name and only then releases the writer's lock. A crash at any point leaves either no
final file or a complete one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.format import fp8
from hidden_state_reader.format.header import (
    FORMAT_VERSION,
    HIDDEN_STATES,
    TOKEN_IDS,
    Meta,
    encode_header,
)
from hidden_state_reader.format.loss_mask import LOSS_MASK, as_mask_tensor
from hidden_state_reader.format.names import temp_path
from hidden_state_reader.kernels.crc import Crc32, crc32
from hidden_state_reader.kernels.fp8 import quantize

# Tensors written after hidden_states, in this order, when a file has them: the fp8
# scales (collected while the hidden states stream in) and the loss mask.
TRAILING = (fp8.SCALES, LOSS_MASK)

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are handled, never at import: the format's names,
# header parser and locks must stay importable without it (writers have it loaded).


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (contiguous copies are made if needed)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


# Float formats: (signed view, unsigned view, lowest bit pattern with all exponent bits set).
# A value is NaN or +-inf exactly when its exponent bits are all ones, so the largest
# signed pattern catches positive ones and the largest unsigned pattern negative ones.
@cache
def _float_bits() -> dict[torch.dtype, tuple[torch.dtype, Any, int, int]]:
    # numpy too is imported on first use: the `hidden-state` CLI imports this module.
    import numpy as np
    import torch

    return {
        torch.bfloat16: (torch.int16, np.uint16, 0x7F80, 0xFF80),
        torch.float16: (torch.int16, np.uint16, 0x7C00, 0xFC00),
        torch.float32: (torch.int32, np.uint32, 0x7F800000, 0xFF800000),
    }


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor holds NaN or +-inf.

    For bf16/fp16/fp32 this works on the raw bits with two reductions and no temporary
    (``torch.isfinite`` on bf16 is slow on CPUs).
    """
    import torch

    if tensor.numel() == 0:
        return False
    spec = _float_bits().get(tensor.dtype)
    if spec is None or tensor.device.type != "cpu":
        return not bool(torch.isfinite(tensor).all())
    signed, unsigned, positive, negative = spec
    bits = tensor.detach().contiguous().view(signed).numpy()
    return bool(bits.max() >= positive or bits.view(unsigned).max() >= negative)


def _initial_metadata(
    metadata: Mapping[str, str] | None, *, model_dtype: str, checksum: bool, nonfinite: bool
) -> dict[str, str]:
    """The metadata to encode first, with fixed-width placeholders patched at the end."""
    meta = dict(metadata or {})
    # Marks files published atomically by this module (readers may map them).
    meta.setdefault(Meta.FORMAT, FORMAT_VERSION)
    # What the hidden states were computed in (fp8 storage overrides: see _use_fp8).
    meta.setdefault(Meta.MODEL_DTYPE, model_dtype)
    if nonfinite:
        meta[Meta.NONFINITE] = "0"
    if checksum:
        meta[Meta.CRC32] = "0" * 8
    return meta


def _check_storage(final_path: str, hidden_dtype: torch.dtype, storage: str) -> None:
    """Reject an unknown ``storage`` and fp8 passed as the model's dtype."""
    import torch

    fp8.check_storage(storage, "storage")
    if hidden_dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"{final_path}: pass the model's dtype as hidden_dtype and storage='fp8_e4m3' "
            "(fp8 hidden states need their scales)"
        )


def _cpu_token_ids(
    token_ids: torch.Tensor, hidden_shape: tuple[int, int, int], final_path: str
) -> torch.Tensor:
    """``token_ids`` as a flat CPU int64 tensor, one per hidden-state row (else ValueError)."""
    import torch

    tokens = token_ids.detach().to("cpu", torch.int64).reshape(-1)
    if tokens.shape[0] != hidden_shape[0]:
        raise ValueError(
            f"{final_path}: {tokens.shape[0]} token ids for {hidden_shape[0]} hidden states"
        )
    return tokens


def _directory_fd(final_path: str, dir_fd: int | None) -> int:
    """A descriptor of the directory ``final_path`` is published in (a copy of ``dir_fd``)."""
    if dir_fd is not None:
        return os.dup(dir_fd)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    return os.open(os.path.dirname(final_path) or ".", flags)


class SampleFileWriter:
    """Streams one sample to disk and publishes it atomically.

    Args:
        final_path: Where the sample must appear, ``NAME.safetensors``.
        token_ids: 1-D integer tensor (stored as int64).
        hidden_shape: ``(tokens, layers, hidden)``.
        hidden_dtype: dtype of ``hidden_states`` (the model's, also with fp8 storage).
        metadata: The ``__metadata__`` map.
        lock: The writer's lock, released after publication (or failure).
        checksum: Record a CRC32 of the tensor bytes in the metadata (default on; it is
            computed over each chunk as it is written, in the writing thread).
        record_nonfinite: Record whether ``hidden_states`` contains NaN/inf (the caller
            reports it through ``note_nonfinite``).
        fsync: Make the file and its directory entry durable before releasing the lock.
        dir_fd: A descriptor of the target directory (the writer duplicates it): the file
            is created and renamed there, whatever its path leads to by then.
        loss_mask: Optional ``[tokens]`` 0/1 (bool or integer tensor, or a sequence),
            stored as ``loss_mask`` (U8) after ``hidden_states``.
        storage: ``"model"``, or ``"fp8_e4m3"``: ``write_hidden`` then takes fp8 bytes
            (``kernels.fp8.quantize``) and ``write_scales`` their scales. ``hidden_dtype`` is
            recorded as ``model_dtype`` (with ``"model"`` storage unless ``metadata``
            already has one).
        crc: The CRC32 function (default: the fastest found, ``kernels.crc``); a
            benchmark passes one that times its calls.
    """

    def __init__(
        self,
        final_path: str,
        *,
        token_ids: torch.Tensor,
        hidden_shape: tuple[int, int, int],
        hidden_dtype: torch.dtype,
        metadata: Mapping[str, str] | None = None,
        lock: WriterLock | None = None,
        checksum: bool = True,
        record_nonfinite: bool = False,
        fsync: bool = False,
        dir_fd: int | None = None,
        loss_mask: torch.Tensor | Sequence[int] | None = None,
        storage: str = fp8.STORAGE_MODEL,
        crc: Crc32 = crc32,
    ) -> None:
        import torch

        _check_storage(final_path, hidden_dtype, storage)
        self.final_path = final_path
        self.lock = lock
        self._fsync = fsync
        from hidden_state_reader.format.tensors import DTYPE_NAMES

        self._meta = _initial_metadata(
            metadata,
            model_dtype=DTYPE_NAMES[hidden_dtype],
            checksum=checksum,
            nonfinite=record_nonfinite,
        )
        self._crc: int | None = 0 if checksum else None
        self._crc32 = crc
        self._tokens = _cpu_token_ids(token_ids, hidden_shape, final_path)
        self._tensors = {
            TOKEN_IDS: (torch.int64, (hidden_shape[0],)),
            HIDDEN_STATES: (hidden_dtype, tuple(hidden_shape)),
        }
        self._mask: torch.Tensor | None = None
        if loss_mask is not None:
            self._mask = as_mask_tensor(loss_mask, hidden_shape[0], final_path)
            self._tensors[LOSS_MASK] = (torch.uint8, (hidden_shape[0],))
        self._scales: list[memoryview] | None = None
        if storage == fp8.STORAGE_FP8:
            self._use_fp8(hidden_dtype, hidden_shape)
        self._layout = encode_header(self._tensors, self._meta, trailing=TRAILING)
        if self._mask is not None and self._layout.offsets[LOSS_MASK][1] != (
            self._layout.file_size - self._layout.data_start
        ):
            raise AssertionError("loss_mask is not the last tensor of the layout")
        self._encoded_meta = dict(self._meta)
        begin, end = self._layout.offsets[HIDDEN_STATES]
        self._hidden_remaining = end - begin
        self.tmp_path = temp_path(final_path)
        self._open_temp(dir_fd)

    def _use_fp8(self, model_dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
        """Store ``hidden_states`` as fp8, its scales last (they are appended at publish)."""
        import torch

        from hidden_state_reader.format.tensors import DTYPE_NAMES

        self._meta[Meta.MODEL_DTYPE] = DTYPE_NAMES[model_dtype]
        self._tensors[HIDDEN_STATES] = (torch.float8_e4m3fn, shape)
        self._tensors[fp8.SCALES] = (torch.float32, (shape[0], shape[1], 1))
        self._scales = []

    def _open_temp(self, dir_fd: int | None) -> None:
        """Create the temp file and write the header and ``token_ids`` into it."""
        final_path = self.final_path
        # Every later step goes through the directory's descriptor, so a directory that is
        # renamed meanwhile still gets its complete file, and a failure still removes the
        # temp file (paths would point elsewhere).
        self._dir_fd: int | None = _directory_fd(final_path, dir_fd)
        self._name = os.path.basename(final_path)
        self._tmp_name = os.path.basename(self.tmp_path)
        try:
            self._fd: int | None = os.open(
                self._tmp_name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                0o644,
                dir_fd=self._dir_fd,
            )
        except BaseException:
            self._close_dir()
            raise
        try:
            self._write(self._layout.header, checksum=False)
            self._write(tensor_bytes(self._tokens))
        except BaseException:
            self._discard()
            raise

    @property
    def total_bytes(self) -> int:
        """Size of the finished file."""
        return self._layout.file_size

    def _write(self, data: Any, *, checksum: bool = True) -> None:
        view = memoryview(data).cast("B")
        if checksum and self._crc is not None:
            self._crc = self._crc32(view, self._crc)
        assert self._fd is not None
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def write_hidden(self, chunk: Any) -> None:
        """Append the next bytes of ``hidden_states`` (row-major, ``[tokens, layers, hidden]``).

        Args:
            chunk: Anything exposing the buffer protocol (bytes, memoryview, numpy) or a
                CPU tensor.
        """
        import torch

        data = tensor_bytes(chunk) if isinstance(chunk, torch.Tensor) else memoryview(chunk)
        n = data.nbytes
        if n > self._hidden_remaining:
            raise ValueError(f"{self.final_path}: {n} bytes more than hidden_states holds")
        self._write(data)
        self._hidden_remaining -= n

    def write_scales(self, scales: torch.Tensor) -> None:
        """Add the fp8 scales of the rows written so far (float32 ``[rows, layers, 1]``).

        They are kept in memory (4 bytes per token and layer) and written after
        ``hidden_states`` when the file is published.
        """
        import torch

        if self._scales is None:
            raise ValueError(f"{self.final_path}: scales given for a file not stored as fp8")
        # A copy: the caller's buffer (a reused host slab) may change before publish.
        self._scales.append(tensor_bytes(scales.detach().to("cpu", torch.float32, copy=True)))

    def _write_scales(self) -> None:
        """Append the collected scales; they must cover the scales tensor exactly."""
        if self._scales is None:
            return
        begin, end = self._layout.offsets[fp8.SCALES]
        got = sum(view.nbytes for view in self._scales)
        if got != end - begin:
            raise ValueError(f"{self.final_path}: {got} bytes of scales, {end - begin} expected")
        for view in self._scales:
            self._write(view)

    def note_nonfinite(self, found: bool) -> None:
        """Record that ``hidden_states`` contains NaN or inf values."""
        if found and Meta.NONFINITE in self._meta:
            self._meta[Meta.NONFINITE] = "1"

    def publish(self) -> str:
        """Finish the file, rename it to its final name, then release the lock.

        Returns:
            The final path.

        Raises:
            ValueError: Fewer hidden-state bytes were written than the shape needs.
            OSError: The filesystem failed; nothing is published and the lock is marked
                failed and released.
        """
        if self._hidden_remaining:
            self.abort(f"{self._hidden_remaining} hidden-state bytes were never written")
            raise ValueError(f"{self.final_path}: incomplete hidden_states")
        try:
            self._write_scales()
            fd = self._fd
            assert fd is not None
            if self._mask is not None:
                self._write(tensor_bytes(self._mask))
            if self._crc is not None:
                self._meta[Meta.CRC32] = f"{self._crc & 0xFFFFFFFF:08x}"
            if self._meta != self._encoded_meta:
                patched = encode_header(self._tensors, self._meta, trailing=TRAILING)
                if len(patched.header) != len(self._layout.header):
                    raise AssertionError("fixed-width metadata changed the header size")
                os.pwrite(fd, patched.header, 0)
            if self._fsync:
                os.fsync(fd)
            os.close(fd)
            self._fd = None
            dir_fd = self._dir_fd
            os.replace(self._tmp_name, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            if self._fsync:
                assert dir_fd is not None
                os.fsync(dir_fd)
        except BaseException as exc:
            self.abort(f"publish failed: {exc!r}")
            raise
        self._close_dir()
        if self.lock is not None:
            self.lock.release()
        return self.final_path

    def abort(self, reason: str) -> None:
        """Give up: remove the temp file, mark the lock failed, release it (idempotent)."""
        self._discard()
        if self.lock is not None:
            self.lock.fail(reason)

    def _discard(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp_name, dir_fd=self._dir_fd)
        self._close_dir()

    def _close_dir(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            os.close(dir_fd)


def write_sample(
    path: str | os.PathLike[str],
    token_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    *,
    metadata: Mapping[str, str] | None = None,
    use_lock: bool = True,
    checksum: bool = True,
    fsync: bool = False,
    loss_mask: torch.Tensor | Sequence[int] | None = None,
    storage: str = fp8.STORAGE_MODEL,
) -> str:
    """Write one complete sample atomically (lock, temp file, rename, unlock).

    Args:
        path: Final ``NAME.safetensors`` path.
        token_ids: ``[tokens]`` integer tensor.
        hidden_states: ``[tokens, layers, hidden]`` tensor (bf16, fp16 or fp32).
        metadata: ``__metadata__`` string map (see ``sample_metadata``).
        use_lock: Create and hold the companion lock while writing.
        checksum: Record a CRC32 of the tensor bytes (default on).
        fsync: Make the file durable before publishing.
        loss_mask: Optional ``[tokens]`` 0/1 per token id (1: the loss counts it).
        storage: ``"model"`` (as given) or ``"fp8_e4m3"`` (quantized, see ``fp8.py``).

    Returns:
        The final path.
    """
    final = os.fspath(path)
    if hidden_states.dim() != 3:
        raise ValueError(f"{final}: hidden_states must be [tokens, layers, hidden]")
    hidden = hidden_states.detach().to("cpu").contiguous()
    lock = WriterLock.create(final) if use_lock else None
    try:
        writer = SampleFileWriter(
            final,
            token_ids=token_ids,
            hidden_shape=(hidden.shape[0], hidden.shape[1], hidden.shape[2]),
            hidden_dtype=hidden.dtype,
            metadata=metadata,
            lock=lock,
            checksum=checksum,
            record_nonfinite=True,
            fsync=fsync,
            loss_mask=loss_mask,
            storage=storage,
        )
    except BaseException as exc:
        if lock is not None:
            lock.fail(f"cannot create {final}: {exc!r}")
        raise
    _fill(writer, hidden, storage)
    return writer.publish()


def _fill(writer: SampleFileWriter, hidden: torch.Tensor, storage: str) -> None:
    """Write all of ``hidden`` (quantized for fp8 storage); abort the file on failure."""
    import torch

    try:
        writer.note_nonfinite(bool(hidden.numel()) and not bool(torch.isfinite(hidden).all()))
        if storage == fp8.STORAGE_FP8:
            hidden, scales = quantize(hidden)
            writer.write_scales(scales)
        writer.write_hidden(hidden)
    except BaseException as exc:
        writer.abort(f"write failed: {exc!r}")
        raise
