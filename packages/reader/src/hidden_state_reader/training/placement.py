"""Putting built batches on the training device: page-locked buffers, a side stream.

``HiddenStateLoader(..., device=...)`` delivers batches already on the device. The host
side of each copy is page-locked memory the batch was built in (``batch_slots`` for
worker processes, ``HostArenas`` in the training process), the copy runs on a side
stream while the loop trains, and fp8 batches cross as fp8 codes plus scales and are
dequantized on the device (a reader ``dtype`` is applied there too). The training loop
only makes its stream wait for the copy (``deliver``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_reader.format import fp8
from hidden_state_reader.format.header import Meta
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.batch_memory import TensorSpec, carve, layout
from hidden_state_reader.training.collate import SCALES


@dataclass
class Placed:
    """A batch on its device and the event its copies end with (None off CUDA)."""

    batch: Any
    ready: torch.cuda.Event | None


class HostArenas:
    """One builder thread's reusable batch buffers (page-locked for a CUDA device).

    Batch ``k`` is built in buffer ``k % count``; before a buffer is reused, the copy
    that last read it is waited for. A batch larger than its buffer gets a larger one.

    Args:
        count: Buffers, so batch ``k + 1`` is built while batch ``k`` is copied.
        pin: Page-locked memory (CUDA), else ordinary memory.
    """

    def __init__(self, count: int, pin: bool) -> None:
        self.pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._copies: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def allocate(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Tensors for ``specs`` in the next buffer (an ``Allocate`` for the collates)."""
        index = self._next
        copy = self._copies[index]
        if copy is not None:
            copy.synchronize()  # this thread waits for the device to finish reading it
            self._copies[index] = None
        size = layout(specs)[1]
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < size:
            # Room for a quarter more: batch sizes vary, and page-locking is slow.
            size += size // 4
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[index] = buffer
        return carve(buffer, specs)

    def copied(self, event: torch.cuda.Event | None) -> None:
        """The batch just allocated is being copied out until ``event``; move on."""
        self._copies[self._next] = event
        self._next = (self._next + 1) % len(self._buffers)


class Placement:
    """Moves a built batch to the device and finishes it there (fp8, dtype).

    Args:
        device: The target device.
        dequantize: Dequantize fp8 batches (``hidden_states`` + ``hidden_states_scales``)
            on the device; False keeps them raw (the reader's ``raw_fp8=True``).
        dtype: The reader's ``dtype``: the dtype of dequantized or converted hidden
            states (None: the writer's ``model_dtype`` for fp8, as stored otherwise).
    """

    def __init__(self, device: torch.device, dequantize: bool, dtype: torch.dtype | None) -> None:
        self.device = device
        self.dequantize = dequantize
        self.dtype = dtype
        self.cuda = device.type == "cuda"

    def place(self, batch: Any, fp8_dtype: torch.dtype | None = None) -> Placed:
        """``batch`` on the device (copies queued on this thread's side stream).

        Args:
            batch: The built batch, its tensors in page-locked memory for CUDA.
            fp8_dtype: What fp8 hidden states dequantize to when the reader has no
                ``dtype`` (the writers' ``model_dtype``, see ``fp8_target``).
        """
        if not self.cuda:
            return Placed(self._finish(_to(batch, self.device), fp8_dtype), None)
        stream = _thread_stream(self.device)
        with torch.cuda.stream(stream):
            moved = self._finish(_to(batch, self.device), fp8_dtype)
            event = torch.cuda.Event()
            event.record(stream)
        return Placed(moved, event)

    def _finish(self, batch: Any, fp8_dtype: torch.dtype | None) -> Any:
        if not isinstance(batch, dict) or "hidden_states" not in batch:
            return batch
        if SCALES in batch and self.dequantize:
            target = self.dtype or fp8_dtype or torch.bfloat16
            batch["hidden_states"] = fp8.dequantize(
                batch["hidden_states"], batch.pop(SCALES), target
            )
        elif SCALES not in batch and self.dtype is not None:
            batch["hidden_states"] = batch["hidden_states"].to(self.dtype)
        return batch


def _to(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` (dicts, lists, tuples) on ``device``, without blocking."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(value, device) for value in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def deliver(placed: Placed, device: torch.device) -> Any:
    """The batch, usable on the training loop's current stream."""
    if placed.ready is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(placed.ready)
        for tensor in _tensors(placed.batch):
            if tensor.device.type == "cuda":
                # Memory made on the copy stream and freed after use on this one.
                tensor.record_stream(current)
    return placed.batch


_STREAMS = threading.local()


def _thread_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's copy stream on ``device`` (made once per thread and device)."""
    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


def fp8_target(samples: Sequence[Sample]) -> torch.dtype | None:
    """The one dtype fp8 samples of a batch dequantize to (the writers' ``model_dtype``).

    None when the samples are not raw fp8.

    Raises:
        ValueError: The writers of the samples recorded different model dtypes.
    """
    if not samples or samples[0].hidden_states_scales is None:
        return None
    dtypes = {fp8.model_dtype(s.metadata.get(Meta.MODEL_DTYPE), s.path) for s in samples}
    if len(dtypes) > 1:
        raise ValueError(
            f"cannot batch fp8 samples whose writers recorded different model dtypes "
            f"({sorted(str(d) for d in dtypes)}, e.g. {samples[0].path}); pass dtype=... "
            "to the dataset"
        )
    return dtypes.pop()
