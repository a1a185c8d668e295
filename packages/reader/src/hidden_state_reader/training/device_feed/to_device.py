"""Stage 2 of the device feed: the copy to the device, and the hand-over to the loop.

Each builder thread queues its batch's copies, and the work after them (the device
finishing), on its own CUDA stream without blocking, and records an event there: the
thread reuses the batch's host buffer once the event has passed (``host_build``). When
the training loop receives the batch, its stream waits for that event, and every device
tensor is marked as used on it (``record_stream``), so the caching allocator never
hands the memory out while the loop still reads it. A tensor that is not page-locked
is staged there first (``sample.placement.to_device``). Off CUDA there is no stream and
no event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from hidden_state_reader.sample.placement import to_device


class ToDevice:
    """One builder thread's stage 2: its batches' copies, on its own CUDA stream.

    Made in the thread that uses it.

    Args:
        device: Where batches go.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def move(self, batch: Any, then: Callable[[Any], Any]) -> tuple[Any, torch.cuda.Event | None]:
        """``then`` of the batch on the device, and the event its copies and work end with.

        Args:
            batch: A batch in host memory (dicts, lists and tuples of tensors).
            then: The work on the device after the copies (``device_finishing``),
                queued on the same stream.

        Returns:
            What ``then`` gives, and the event (None off CUDA).
        """
        if self.stream is None:
            return then(copy_to(batch, self.device)), None
        with torch.cuda.stream(self.stream):
            moved = then(copy_to(batch, self.device))
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event


def copy_to(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` (dicts, lists, tuples) on ``device``, without blocking."""
    if isinstance(batch, torch.Tensor):
        return to_device(batch, device)
    if isinstance(batch, dict):
        return {key: copy_to(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(copy_to(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(copy_to(value, device) for value in batch)
    return batch


def hand_over(batch: Any, ready: torch.cuda.Event | None, device: torch.device) -> Any:
    """``batch``, usable on the training loop's current stream once its copy is done."""
    if ready is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(ready)
        for tensor in _tensors(batch):
            if tensor.device.type == "cuda":
                # Memory made on the builder's stream and freed after use on this one.
                tensor.record_stream(current)
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
