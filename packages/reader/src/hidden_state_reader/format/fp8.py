"""Opt-in fp8 storage of hidden states: names, validation, quantize and dequantize.

A sample stored in fp8 holds ``hidden_states`` as ``F8_E4M3`` (``torch.float8_e4m3fn``)
``[tokens, layers, hidden]`` together with ``hidden_states_scales``, float32
``[tokens, layers, 1]``: one scale per token and captured layer. Dequantization is
``hidden_states.float() * hidden_states_scales`` (the scales broadcast), the same rule
and tensor names as vLLM speculators' ``hs_connectors`` fp8 backend, whose scales are
``[tokens, 1, 1]`` (one per token over all layers); files of either granularity read
with either reader. See ``docs/format.md`` for the error bound.

Quantization: ``scale = max(amax / 448, 1e-12)`` over each row's hidden dimension,
``q = clamp(x / scale, -448, 448)`` rounded to nearest e4m3.

The names and ``check_scales`` need no torch; ``quantize`` and ``dequantize`` import it
when called, so ``import hidden_state_reader.format`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hidden_state_reader.errors import CorruptSampleError

if TYPE_CHECKING:
    import torch

SCALES = "hidden_states_scales"
"""Name of the scales tensor (as in speculators' ``hs_connectors.fp8_utils.SCALES_KEY``)."""
FP8_DTYPE = "F8_E4M3"
"""safetensors name of ``torch.float8_e4m3fn``."""
SCALES_DTYPE = "F32"
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; a row's absolute maximum maps onto it."""
MIN_SCALE = 1e-12
"""Floor of a scale, so an all-zero row divides by something (it stays zero)."""

STORAGE_MODEL = "model"
"""Store hidden states in the model's dtype (the default)."""
STORAGE_FP8 = "fp8_e4m3"
"""Store hidden states as float8_e4m3fn with per-token, per-layer float32 scales."""
STORAGE_DTYPES = (STORAGE_MODEL, STORAGE_FP8)

# Elements quantized per step on the CPU: bounds the float32 scratch (16 MiB) whatever
# the sample's size, while keeping the steps (each a torch parallel region, whose barrier
# is costly on a loaded machine) few.
_BLOCK_ELEMS = 1 << 22


def check_storage(value: str, what: str = "storage_dtype") -> str:
    """Validate a storage-dtype setting.

    Raises:
        ValueError: Not one of ``STORAGE_DTYPES``; the message names ``what``.
    """
    if value not in STORAGE_DTYPES:
        raise ValueError(f"{what}: must be one of {', '.join(STORAGE_DTYPES)}, got {value!r}")
    return value


def check_scales(
    path: str,
    hidden_dtype: str,
    hidden_shape: Sequence[int],
    scales: tuple[str, Sequence[int]] | None,
) -> None:
    """Header rule: fp8 hidden states come with their scales, and scales only with fp8.

    Args:
        path: The file, for error messages.
        hidden_dtype: safetensors dtype of ``hidden_states``.
        hidden_shape: Its shape ``[tokens, layers, hidden]``.
        scales: dtype and shape of ``hidden_states_scales``, None if absent.

    Raises:
        CorruptSampleError: The pair does not match; the message names the file.
    """
    if scales is None:
        if hidden_dtype == FP8_DTYPE:
            raise CorruptSampleError(
                path,
                f"hidden_states is {FP8_DTYPE} but the file has no {SCALES!r} tensor; "
                "it cannot be dequantized (rewrite it, or delete it)",
            )
        return
    dtype, shape = scales
    if hidden_dtype != FP8_DTYPE:
        raise CorruptSampleError(
            path, f"{SCALES!r} is only valid with {FP8_DTYPE} hidden_states, not {hidden_dtype}"
        )
    tokens, layers = hidden_shape[0], hidden_shape[1]
    if dtype != SCALES_DTYPE or tuple(shape) not in ((tokens, layers, 1), (tokens, 1, 1)):
        raise CorruptSampleError(
            path,
            f"{SCALES!r} must be F32 [{tokens}, {layers}, 1] or [{tokens}, 1, 1] for "
            f"hidden_states {list(hidden_shape)}, got {dtype} {list(shape)}",
        )


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
    lookup-table kernel, or torch passes where it is not built (``format.fp8_cpu``), bit
    for bit the same and much faster than torch's float8 conversion; large results go
    into recycled huge-page-advised memory (``format.hostmem``).

    Args:
        fp8: ``[tokens, layers, hidden]`` float8_e4m3fn.
        scales: float32 ``[tokens, layers, 1]`` or ``[tokens, 1, 1]``.
        dtype: Result dtype (default bfloat16).
        pin_memory: Allocate the (CPU) result in page-locked memory.

    Returns:
        The hidden states in ``dtype``.
    """
    import torch

    from hidden_state_reader.format import fp8_cpu, hostmem

    dtype = dtype or torch.bfloat16
    if fp8.device.type == "cpu":
        out = hostmem.empty(tuple(fp8.shape), dtype, pin_memory=pin_memory)
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


DEQUANT_DTYPES = ("BF16", "F16", "F32")
"""``model_dtype`` values an fp8 file may record: the dtypes it is dequantized to."""


def check_model_dtype(name: str | None, path: str) -> str:
    """The safetensors name of the dtype to dequantize to: the recorded one, else BF16.

    Torch-free, so the listing commands apply the same rule as the loader.

    Args:
        name: The ``model_dtype`` metadata value, or None.
        path: The file, for error messages.

    Raises:
        CorruptSampleError: The recorded name is not one of ``DEQUANT_DTYPES``.
    """
    if name is None:
        return "BF16"
    if name not in DEQUANT_DTYPES:
        raise CorruptSampleError(
            path, f"metadata model_dtype {name!r} is not one of {sorted(DEQUANT_DTYPES)}"
        )
    return name


def model_dtype(name: str | None, path: str) -> torch.dtype:
    """The dtype to dequantize to: the one recorded by the writer, else bfloat16.

    Args:
        name: The ``model_dtype`` metadata value (a safetensors dtype name), or None.
        path: The file, for error messages.

    Raises:
        CorruptSampleError: The recorded name is not a float dtype this format knows.
    """
    import torch

    known = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    return known[check_model_dtype(name, path)]
