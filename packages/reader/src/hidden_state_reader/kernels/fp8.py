"""fp8 quantize and dequantize: the arithmetic of the format's fp8 storage (``format.fp8``).

Quantization: ``scale = max(amax / 448, 1e-12)`` over each row's hidden dimension,
``q = clamp(x / scale, -448, 448)`` rounded to nearest e4m3. Dequantization on the CPU
goes through the native kernel (``kernels.fp8_cpu``); torch is imported when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hidden_state_reader.format.fp8 import FP8_MAX, MIN_SCALE

if TYPE_CHECKING:
    import torch

# Elements quantized per step on the CPU: bounds the float32 scratch (16 MiB) whatever
# the sample's size, while keeping the steps (each a torch parallel region, whose barrier
# is costly on a loaded machine) few.
_BLOCK_ELEMS = 1 << 22


def quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize hidden states to float8_e4m3fn with one scale per token and layer.

    Runs on the tensor's device (on CUDA before the device-to-host copy, which then
    moves half the bytes of bf16).

    Args:
        hidden: ``[tokens, layers, hidden]`` in any float dtype.

    Returns:
        ``(fp8 [tokens, layers, hidden], float32 scales [tokens, layers, 1])``. A row
        holding NaN gets a NaN scale (the row reads back as NaN); one holding inf an
        inf scale.
    """
    import torch

    if hidden.dim() != 3:
        raise ValueError(f"hidden states must be [tokens, layers, hidden], got {hidden.shape}")
    # abs and max are exact in the source dtype: no float32 copy of the whole tensor.
    scales = hidden.abs().amax(dim=-1, keepdim=True).float().div_(FP8_MAX).clamp_(min=MIN_SCALE)
    out = torch.empty(hidden.shape, dtype=torch.float8_e4m3fn, device=hidden.device)
    for start, stop, scratch in _blocks(hidden):
        scratch.copy_(hidden[start:stop]).div_(scales[start:stop]).clamp_(-FP8_MAX, FP8_MAX)
        out[start:stop].copy_(scratch)
    return out, scales


def dequantize(
    fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Dequantize fp8 hidden states: ``fp8.float() * scales``, rounded once to ``dtype``.

    Works on any device: move both tensors to the GPU first to dequantize there (half
    the host-to-device bytes of bf16). On the CPU the result is computed by the native
    lookup-table kernel, or torch passes where it is not built (``kernels.fp8_cpu``), bit
    for bit the same and much faster than torch's float8 conversion; large results go
    into recycled huge-page-advised memory (``kernels.host_memory``).

    Args:
        fp8: ``[tokens, layers, hidden]`` float8_e4m3fn.
        scales: float32 ``[tokens, layers, 1]`` or ``[tokens, 1, 1]``.
        dtype: Result dtype (default bfloat16).
        pin_memory: Allocate the (CPU) result in page-locked memory.

    Returns:
        The hidden states in ``dtype``.
    """
    import torch

    from hidden_state_reader.kernels import fp8_cpu, host_memory

    dtype = dtype or torch.bfloat16
    if fp8.device.type == "cpu":
        out = host_memory.empty(tuple(fp8.shape), dtype, pin_memory=pin_memory)
        return fp8_cpu.dequantize_into(fp8, scales.to(torch.float32), out)
    # On an accelerator the conversions are fast kernels: one float32 temporary.
    return fp8.to(torch.float32).mul_(scales).to(dtype)


def _blocks(tensor: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """Token ranges and a float32 scratch view for each, on the tensor's device.

    On CUDA one block covers everything (kernels are fast; the scratch is the one
    temporary); on the CPU blocks of about ``_BLOCK_ELEMS`` keep the scratch in cache.
    """
    import torch

    tokens = tensor.shape[0]
    row = max(1, tensor[0].numel()) if tokens else 1
    step = tokens if tensor.device.type != "cpu" else max(1, _BLOCK_ELEMS // row)
    step = max(1, step)
    scratch = torch.empty(
        (min(step, tokens), *tensor.shape[1:]), dtype=torch.float32, device=tensor.device
    )
    return [
        (start, min(start + step, tokens), scratch[: min(start + step, tokens) - start])
        for start in range(0, tokens, step)
    ]
