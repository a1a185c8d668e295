"""Each step's staging rows to host memory, without holding up the model's stream.

The staging buffer is overwritten by the next forward pass, and the rows of a step are
routed to their requests on the host (that needs the slot mapping there). Copying straight
to the host would make the next forward pass wait for the host link; instead the rows are
first copied on the device into a shadow buffer (a fraction of a millisecond), the model's
stream waits only for that, and the shadow goes to page-locked host memory on a side
stream while the next step computes. On the CPU build the rows are simply copied. On the
host a step's rows are token-major (``[n, layers, hidden]``: the device-side copy
transposes them), the arena's layout, so the rows of a run of tokens land in the arena in
one contiguous copy.

Host buffers come in a small ring: when the host falls ``depth`` steps behind, ``submit``
waits for a buffer (bounded memory, never a lost step).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_reader.kernels import host_memory


@dataclass
class StepCopy:
    """One step's rows on their way to the host.

    Attributes:
        index: Its host buffer in the ring.
        rows: ``[n, layers, hidden]`` host view (valid after ``wait``).
        slots: ``[n]`` KV slot of each row, on the host (valid after ``wait``).
        landed: CUDA event recorded after the copies (None on the CPU: already there).
    """

    index: int
    rows: torch.Tensor
    slots: torch.Tensor
    landed: Any = None

    def wait(self) -> None:
        """Block until the copies have landed in host memory."""
        if self.landed is not None:
            self.landed.synchronize()


class StepTransfer:
    """Copies the staging rows of each step into a ring of host buffers.

    Args:
        staging_rows: The staging buffer (``[layers, max_tokens, hidden]``).
        depth: Host buffers in the ring (steps the host may fall behind).
    """

    def __init__(self, staging_rows: torch.Tensor, depth: int = 2) -> None:
        self.staging = staging_rows
        self.device = staging_rows.device
        self.on_cuda = self.device.type == "cuda"
        layers, tokens, hidden = staging_rows.shape
        pinned = self.on_cuda
        with torch.inference_mode():
            # Page-locked on CUDA (the copies run asynchronously), from the host-memory home.
            shape = (tokens, layers, hidden)
            self._host = [
                host_memory.empty(shape, staging_rows.dtype, pin_memory=pinned)
                for _ in range(depth)
            ]
            self._host_slots = [
                host_memory.empty((tokens,), torch.int64, pin_memory=pinned) for _ in range(depth)
            ]
            if self.on_cuda:
                self._shadow = torch.empty(shape, dtype=staging_rows.dtype, device=self.device)
                self._shadow_slots = torch.empty(tokens, dtype=torch.int64, device=self.device)
                self._stream = torch.cuda.Stream(self.device)
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(depth):
            self._free.put(index)

    @property
    def host_bytes(self) -> int:
        """Host memory the ring holds."""
        return sum(t.numel() * t.element_size() for t in self._host + self._host_slots)

    def submit(self, num_rows: int, slots: torch.Tensor) -> StepCopy:
        """Start copying rows ``[0, num_rows)`` of the step that was just enqueued.

        Called on the engine's thread after the forward pass was enqueued; may wait for a
        free host buffer.
        """
        with torch.inference_mode():  # the buffers are inference tensors
            return self._submit(num_rows, slots)

    def _submit(self, num_rows: int, slots: torch.Tensor) -> StepCopy:
        n = min(num_rows, self.staging.shape[1], slots.shape[0])
        index = self._free.get()
        rows, host_slots = self._host[index][:n], self._host_slots[index][:n]
        staged = self.staging[:, :n].transpose(0, 1)  # token-major
        if not self.on_cuda:
            rows.copy_(staged)
            host_slots.copy_(slots[:n])
            return StepCopy(index, rows, host_slots)
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._shadow[:n].copy_(staged)
            self._shadow_slots[:n].copy_(slots[:n])
            copied = torch.cuda.Event()
            copied.record(self._stream)
            rows.copy_(self._shadow[:n], non_blocking=True)
            host_slots.copy_(self._shadow_slots[:n], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        # The next forward pass (and the runner's next slot mapping) overwrite the staging
        # and the slot buffer: only after the device-side copy.
        compute.wait_event(copied)
        return StepCopy(index, rows, host_slots, landed)

    def done(self, copy: StepCopy) -> None:
        """The host is finished with this step's buffer."""
        self._free.put(copy.index)
