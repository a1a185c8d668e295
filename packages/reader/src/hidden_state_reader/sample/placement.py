"""Moving a sample's tensors, as stored, to the trainer's device (``LoadOptions.device``).

They move before any conversion: an fp8 file crosses the host-to-device link as fp8 plus
scales (about half the bytes of bf16) and is dequantized on the device; a bf16 file asked
for in float32 moves as bf16. For CUDA the host side is staged in pinned memory (torch's
caching host allocator reuses those blocks once their copies are done), so the copies
run asynchronously on the current stream and are ordered before any kernel queued on
it after them (dequantization included). For other devices ``Tensor.to`` does the move.
"""

from __future__ import annotations

import torch

from hidden_state_reader.kernels import host_memory


def check_device(device: str | torch.device) -> torch.device:
    """The ``torch.device`` named by ``device``, checked to be usable here.

    Raises:
        ValueError: Not a device name torch knows, or CUDA asked for where there is none.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r}: not a torch device ({exc})") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: CUDA is not available in this process (no GPU, or a "
            "CPU-only torch); leave device unset to read onto the CPU"
        )
    return parsed


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, copied without blocking where it can (CUDA: pinned staging)."""
    target = torch.device(device)
    if tensor.device == target:
        return tensor
    if target.type == "cuda" and tensor.device.type == "cpu":
        if not tensor.is_pinned():
            staged = host_memory.empty(tuple(tensor.shape), tensor.dtype, pin_memory=True)
            tensor = staged.copy_(tensor)
        return tensor.to(target, non_blocking=True)
    return tensor.to(target)
