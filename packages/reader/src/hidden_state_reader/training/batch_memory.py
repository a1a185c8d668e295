"""Where a batch is built: all its tensors carved out of one buffer, written once.

A collate function (``PadCollate``, ``PackCollate``) first validates its samples and
works out every output tensor's shape, then asks an allocator for all of them at once
and copies each sample's rows straight into place. Which memory that is depends on who
collates:

* ``allocate_plain``: ordinary memory in the training process; in a DataLoader worker
  process, one shared-memory block, so the batch crosses to the training process as a
  handle instead of being copied into shared memory when it is sent.
* ``HostArenas`` (the device feed's ``host_build``): a reused page-locked buffer, from
  which the batch is copied to the GPU without a staging copy.

A collate says it builds this way by having ``build_into`` (``InPlaceCollate``).

``copy_rows`` and ``zero`` move bytes on the CPU with numpy (one thread, the GIL
released), so several builder threads never start torch's intra-op thread pools at
once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch
from torch.utils.data import get_worker_info

TensorSpec: TypeAlias = tuple[str, tuple[int, ...], torch.dtype]
"""``(name, shape, dtype)`` of one output tensor of a batch."""
Allocate: TypeAlias = Callable[[Sequence[TensorSpec]], dict[str, torch.Tensor]]
"""Gives uninitialised tensors for every spec (by name), carved from one buffer."""


@runtime_checkable
class InPlaceCollate(Protocol):
    """A collate that builds its batch in memory the caller gives: it has ``build_into``.

    ``HiddenStateLoader(..., device=...)`` hands such a collate samples as stored (fp8
    codes with their ``hidden_states_scales``, the stored dtype) and a reused buffer
    (page-locked for CUDA) to build in, copies the batch to the device from there and
    finishes it on the device (fp8 dequantized, ``dtype`` applied). A collate without
    ``build_into`` gets samples the reader finished on the host, is called as
    ``collate_fn(samples)``, and its batch is copied to the device as it is.
    ``PadCollate`` and ``PackCollate`` build in place. Without ``device=`` every collate
    is called as ``collate_fn(samples)``, so an in-place one is callable too.
    """

    def __call__(self, samples: Sequence[Any], /) -> Any:
        """The batch of ``samples`` in memory of the collate's choosing."""
        ...

    def build_into(self, samples: Sequence[Any], allocate: Allocate, /) -> dict[str, Any]:
        """Build the batch of ``samples`` in the tensors ``allocate`` gives.

        Args:
            samples: ``Sample`` objects, raw fp8 ones included (with their scales).
            allocate: Called once, with the spec of every tensor of the batch; its
                tensors may be reused for a later batch once this one is copied out.

        Returns:
            A dict holding ``hidden_states`` and, for raw fp8 samples, their scales as
            ``hidden_states_scales`` laid out like it (the device dequantizes them);
            other entries are copied to the device as they are.
        """
        ...


ALIGN = 256
"""Byte alignment of each tensor in a batch buffer (enough for any dtype and DMA)."""

# numpy has no bfloat16 or float8: bytes move through the integer type of their width.
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Byte offsets of each spec in one buffer, and the buffer's size."""
    offsets, end = [], 0
    for _, shape, dtype in specs:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += _nbytes(shape, dtype)
    return offsets, end


def carve(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of ``buffer`` (``uint8``, at least ``layout(specs)[1]`` bytes), one per spec."""
    offsets, end = layout(specs)
    if buffer.numel() < end:
        raise ValueError(f"a batch of {end} bytes does not fit a buffer of {buffer.numel()}")
    out = {}
    for (name, shape, dtype), start in zip(specs, offsets, strict=True):
        size = _nbytes(shape, dtype)
        out[name] = buffer[start : start + size].view(dtype).view(shape)
    return out


def allocate_plain(specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """One buffer for the batch: shared memory in a DataLoader worker, else ordinary."""
    _, size = layout(specs)
    if get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(max(size, 1))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    return carve(buffer, specs)


def copy_rows(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination[...] = source`` (same shape and dtype), once over the bytes.

    On the CPU a numpy copy: one thread, the GIL released, any source strides (a
    layer-selected view, a mapped file). Elsewhere ``Tensor.copy_``.
    """
    if destination.device.type != "cpu" or source.device.type != "cpu":
        destination.copy_(source)
        return
    np.copyto(_bytes_view(destination), _bytes_view(source), casting="no")


def zero(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with zero bytes (padding), on the CPU without torch's thread pool."""
    if tensor.device.type != "cpu":
        tensor.zero_()
    elif tensor.numel():
        _bytes_view(tensor).fill(0)


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s elements through the integer type of their width."""
    width = _SAME_WIDTH[tensor.element_size()]
    return (tensor if tensor.dtype == width else tensor.view(width)).numpy()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize
