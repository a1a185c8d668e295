"""Stage 1 of the device feed: a batch built in host memory from its samples.

A collate that builds in place (``batch_memory.InPlaceCollate``: ``PadCollate``,
``PackCollate``) is given samples as stored (fp8 codes with their scales, the stored
dtype; ``device_finishing`` finishes them on the device) and builds into the thread's
reused buffers (``HostArenas``; page-locked for CUDA). Any other collate takes the
regular path: the reader finishes the samples on the host, the collate is called as
``collate_fn(samples)``, and its batch is copied as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hidden_state_reader.kernels.host_memory import byte_buffer
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.batch_memory import (
    InPlaceCollate,
    TensorSpec,
    allocate_plain,
    carve,
    layout,
)


def builds_in_place(collate_fn: Callable[..., Any]) -> bool:
    """Whether ``collate_fn`` declares in-place building (it has ``build_into``)."""
    return isinstance(collate_fn, InPlaceCollate)


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
            buffer = byte_buffer(size, pin=self.pin)
            self._buffers[index] = buffer
        return carve(buffer, specs)

    def copied(self, event: torch.cuda.Event | None) -> None:
        """The batch just allocated is being copied out until ``event``; move on."""
        self._copies[self._next] = event
        self._next = (self._next + 1) % len(self._buffers)

    def settle(self) -> None:
        """Wait for the copies still reading the buffers and drop their events (between passes)."""
        for index, copy in enumerate(self._copies):
            if copy is not None:
                copy.synchronize()
                self._copies[index] = None


class HostBuild:
    """One builder thread's stage 1: collate a batch's samples into host memory.

    Args:
        collate_fn: The loader's collate.
        arenas: The thread's reused buffers (an in-place collate on CUDA), else None:
            every batch in fresh memory.
    """

    def __init__(self, collate_fn: Callable[..., Any], arenas: HostArenas | None) -> None:
        self.collate_fn = collate_fn
        self.arenas = arenas
        self.in_place: InPlaceCollate | None = (
            collate_fn if isinstance(collate_fn, InPlaceCollate) else None
        )

    def build(self, samples: Sequence[Sample]) -> Any:
        """The batch of ``samples``, in this thread's next buffer where it has them.

        Raises:
            TypeError: An in-place collate's batch is not a dict of ``hidden_states``.
        """
        if self.in_place is None:
            return self.collate_fn(samples)
        allocate = allocate_plain if self.arenas is None else self.arenas.allocate
        batch = self.in_place.build_into(samples, allocate)
        if not isinstance(batch, dict) or "hidden_states" not in batch:
            raise TypeError(
                f"{self.collate_fn!r}.build_into returned a {type(batch).__name__} without "
                "'hidden_states'; an InPlaceCollate returns a dict holding them (and fp8 "
                "scales) for the device to finish (hidden_state_reader.training.batch_memory)"
            )
        return batch

    def copied(self, event: torch.cuda.Event | None) -> None:
        """The batch just built is being copied out until ``event`` (None: not on CUDA)."""
        if self.arenas is not None:
            self.arenas.copied(event)
