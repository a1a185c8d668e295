"""Exact fp8 (e4m3fn) dequantization on the CPU.

Two implementations, bit for bit the same as the definition (``reference``: torch's own
``fp8.float() * scales``, then one rounding to the target dtype):

* the native kernel (``_fp8_native``, a C extension built with the package where a C
  compiler exists): each row of ``hidden`` codes shares a scale, so it computes the 256
  possible results once per scale and then only looks codes up, 64 at a time with AVX-512
  VBMI, one at a time elsewhere; the GIL is released meanwhile. bfloat16, float16 (the
  model dtype of fp16 models, and of most quantized ones in vLLM) and float32 results.
  The tables are built 16 or 8 results at a time where the CPU has AVX-512 or AVX2 +
  F16C (``LEVELS``);
* torch passes (other result dtypes, or where the extension is not built): torch converts
  float8 on CPUs one element at a time, so this path is four vectorised passes over
  chunks that stay in cache, by bit manipulation (``torch_passes_into`` says why exact).

How fast each is, and which to use when: docs/reader.md, "How do I read fp8 samples?".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHUNK_ELEMS = (1 << 15) - 1
"""Elements per pass at most: below torch's parallel grain (``at::internal::GRAIN_SIZE``)."""
SCALE_LIMIT = 2.0**119
"""Scales at or above this (or NaN/inf ones, which are fine) would overflow ``scale * 256``."""
_CLEAR_BIT_14 = ~(1 << 14)  # -16385: keeps the sign (bit 15) and the shifted code


def reference(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = fp8.float() * scales`` with torch's own float8 conversion (the definition)."""
    out.copy_(fp8.float().mul_(scales))
    return out


def dequantize_into(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``fp8.float() * scales`` rounded to ``out.dtype`` into ``out``, bit-exactly.

    Uses the native kernel where it is built and ``out`` is bfloat16, float16 or float32, else
    torch passes (``kernel()`` says which).

    Args:
        fp8: float8_e4m3fn ``[..., hidden]`` on the CPU.
        scales: float32 broadcastable to ``[..., 1]`` (one scale per row).
        out: A contiguous tensor of ``fp8``'s shape (float32, bfloat16 or float16).

    Returns:
        ``out``.
    """
    import torch

    if fp8.dtype != torch.float8_e4m3fn:  # e5m2 and others: another code table
        return reference(fp8, scales, out)
    native = _native()
    if (
        native is not None
        and fp8.dim() > 0
        and fp8.numel()
        and scales.dim() > 0
        and (scales.shape[-1] == 1)
    ):
        kind = _NATIVE_KINDS.get(str(out.dtype))
        if kind is not None:
            return native_into(fp8, scales, out)
    return torch_passes_into(fp8, scales, out)


def kernel(dtype: str = "torch.bfloat16") -> str:
    """Which implementation dequantizes to ``dtype`` here (for reports and benchmarks).

    Returns:
        ``"native, "`` and the best of ``LEVELS`` this CPU runs (``"native, AVX-512
        VBMI"``, ``"native, AVX2 + F16C tables"``, ...), or ``"torch passes"``.
    """
    native = _native()
    if native is None or dtype not in _NATIVE_KINDS:
        return "torch passes"
    return f"native, {LEVELS[native.BEST]}"


_NATIVE_KINDS = {"torch.bfloat16": 0, "torch.float32": 1, "torch.float16": 2}


@functools.cache
def _native() -> Any:
    """The compiled kernel module, or None where the package was built without it."""
    try:
        from hidden_state_reader.kernels import _fp8_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _fp8_native


LEVELS = {0: "portable C", 1: "AVX2 + F16C tables", 2: "AVX-512 tables", 3: "AVX-512 VBMI"}
"""What the native kernel may use, by level: each adds to the one before (the table of a
row's 256 results built 8 or 16 at a time; then the lookup 64 codes at a time). Every
level gives the same bits."""


def native_levels() -> list[int]:
    """The levels this CPU runs (``LEVELS``), lowest first; empty without the kernel."""
    native = _native()
    return [] if native is None else [n for n in LEVELS if native.AVAILABLE >> n & 1]


def native_into(
    fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, level: int | None = None
) -> torch.Tensor:
    """``dequantize_into`` with the native kernel (bfloat16, float16 or float32 ``out``).

    Args:
        fp8: As for ``dequantize_into``; a strided view is copied to contiguous codes.
        scales: As for ``dequantize_into``.
        out: A contiguous bfloat16, float16 or float32 tensor of ``fp8``'s shape.
        level: The most the kernel may use (``LEVELS``; tests force each); None: the best
            this CPU has.

    Raises:
        RuntimeError: The extension is not built.
    """
    import torch

    native = _native()
    if native is None:
        raise RuntimeError("hidden_state_reader was built without its native fp8 kernel")
    hidden = fp8.shape[-1]
    rows = fp8.numel() // hidden
    lead = tuple(fp8.shape[:-1])
    if scales.dim() >= 2 and tuple(scales.shape) == (*lead[:-1], 1, 1) and scales.numel():
        per_scale = lead[-1]  # one scale per token for all its layers (speculators' shape)
    else:
        per_scale = 1
        scales = scales.expand(*lead, 1)
    flat_scales = scales.to(torch.float32).reshape(-1).contiguous()
    codes = fp8.contiguous().view(torch.uint8).reshape(rows, hidden)
    target = out.view(torch.int16 if out.dtype.itemsize == 2 else torch.int32)
    native.dequantize(codes.numpy(), flat_scales.numpy(), _code_values().numpy(),
                      target.numpy(), hidden, per_scale, _NATIVE_KINDS[str(out.dtype)],
                      -1 if level is None else level)  # fmt: skip
    return out


@functools.cache
def _code_values() -> torch.Tensor:
    """float32 value of each of the 256 codes, by torch's own conversion (the reference's)."""
    import torch

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


def torch_passes_into(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``dequantize_into`` by torch passes over cache-sized chunks (any float ``out``).

    Why exact: an e4m3fn byte ``s eeee mmm``, sign-extended to 16 bits, shifted left by 7
    and with bit 14 cleared, is the float16 ``s 0eeee mmm0000000``: the code's value times
    2**-8 for every finite code, subnormals included (float16's exponent bias is 15 = 7 + 8
    and its 10 mantissa bits hold e4m3's 3). float16 -> float32 is exact, and so is
    ``scale * 256`` (a power of two; finite for every scale below 2**119), so
    ``half * (scale * 256)`` is the exact product ``value * scale`` rounded once to
    float32: bit for bit the reference ``fp8.float() * scale``, then one rounding to the
    target dtype. The two NaN codes (0x7f, 0xff) would read as +-480; two byte reductions
    per chunk find them and those elements are set to NaN. Samples whose scales are not
    all below 2**119 (no writer of this format makes one: a scale is at most float32's
    maximum / 448) take the reference path.

    The chunks are smaller than torch's parallel grain (32,768 elements), so each pass
    runs on the calling thread: torch's intra-op threads meet at a barrier after every
    pass, which on a machine whose cores are busy with other processes waits for a
    descheduled thread (docs/reader.md). Parallelism comes from more reader processes or
    DataLoader workers.
    """
    import torch

    if fp8.dim() == 0 or fp8.numel() == 0 or scales.dim() == 0 or scales.shape[-1] != 1:
        return reference(fp8, scales, out)
    hidden = fp8.shape[-1]
    per_row = scales.expand(*fp8.shape[:-1], 1).reshape(-1, 1)
    if bool((per_row.abs() >= SCALE_LIMIT).any()):
        return reference(fp8, scales, out)
    scaled = per_row * 256.0
    codes = fp8.reshape(-1, hidden).view(torch.int8)
    rows = codes.shape[0]
    flat = out.view(rows, hidden)
    step = max(1, CHUNK_ELEMS // hidden)
    bits = torch.empty(min(step, rows), hidden, dtype=torch.int16)
    nan_codes = False
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        nan_codes = nan_codes or _has_nan_code(codes[start:stop])
        chunk = bits[: stop - start]
        chunk.copy_(codes[start:stop])  # sign-extends
        chunk.bitwise_left_shift_(7).bitwise_and_(_CLEAR_BIT_14)
        # float16 * float32 computes in float32 and rounds once into out's dtype.
        torch.mul(chunk.view(torch.float16), scaled[start:stop], out=flat[start:stop])
    if nan_codes:  # rare: NaN codes come only from non-finite inputs
        flat[codes.bitwise_and(0x7F) == 0x7F] = float("nan")
    return out


def _has_nan_code(codes: torch.Tensor) -> bool:
    """Whether a chunk holds a NaN code: 0x7f is int8's maximum, 0xff uint8's."""
    import torch

    return int(codes.max()) == 0x7F or int(codes.view(torch.uint8).max()) == 0xFF
