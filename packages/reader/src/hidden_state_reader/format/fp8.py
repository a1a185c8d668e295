"""Opt-in fp8 storage of hidden states: names and validation (the spec).

A sample stored in fp8 holds ``hidden_states`` as ``F8_E4M3`` (``torch.float8_e4m3fn``)
``[tokens, layers, hidden]`` together with ``hidden_states_scales``, float32
``[tokens, layers, 1]``: one scale per token and captured layer. Dequantization is
``hidden_states.float() * hidden_states_scales`` (the scales broadcast), the same rule
and tensor names as vLLM speculators' ``hs_connectors`` fp8 backend, whose scales are
``[tokens, 1, 1]`` (one per token over all layers); files of either granularity read
with either reader. See ``docs/format.md`` for the error bound.

Quantization: ``scale = max(amax / 448, 1e-12)`` over each row's hidden dimension,
``q = clamp(x / scale, -448, 448)`` rounded to nearest e4m3.

The names and checks need no torch (``model_dtype`` imports it when called), so
``import hidden_state_reader.format`` stays torch-free. ``quantize`` and ``dequantize``
are mechanisms: ``hidden_state_reader.kernels.fp8``.
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
