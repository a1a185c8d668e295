"""CPU fp8 dequantization: every implementation bit for bit equal to torch's definition.

The implementations (``kernels.fp8_cpu``): the native kernel's vector lookup (AVX-512 VBMI,
where the CPU has it), its scalar lookup, and the torch passes (float64 results, or where
the extension is not built); ``dequantize`` picks one. Each is checked against
``reference`` (``fp8.float() * scales`` then one rounding) over all 256 codes under scales
from tiny to huge, infinite and NaN, for both scale layouts ([T, 1, 1] and [T, L, 1]).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hidden_state_reader.kernels import fp8_cpu
from hidden_state_reader.kernels.fp8 import dequantize, quantize

SCALES = [1.0, 1e-12, 3.7e-3, 0.1234567, 1 / 448, 7.3, -2.5, 0.0, 1e20, 7.5e35, 2.0**-126,
          1e-40, float("inf"), float("nan"), 2.0**119, 3e38]  # fmt: skip

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _public(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(dequantize(fp8, scales, out.dtype))


def _native_at(level: int) -> Impl:
    return lambda f, s, o: fp8_cpu.native_into(f, s, o, level=level)


# The native kernel at every level this CPU runs (portable C, AVX2 + F16C tables,
# AVX-512 tables, the VBMI lookup): each must give the same bits.
IMPLS: dict[str, Impl] = {
    "dequantize (the default choice)": _public,
    **{f"native, {fp8_cpu.LEVELS[n]}": _native_at(n) for n in fp8_cpu.native_levels()},
    "torch passes": fp8_cpu.torch_passes_into,
}
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def every_code_under_every_scale(hidden: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``[len(SCALES), 2, hidden]`` codes (all 256, cycled from a different start in each
    row, so vector tails see every code too) and ``[len(SCALES), 1, 1]`` scales."""
    rows = [(torch.arange(hidden) + 37 * i) % 256 for i in range(len(SCALES))]
    codes = torch.stack(rows).to(torch.uint8).view(len(SCALES), 1, hidden).expand(-1, 2, -1)
    return codes.contiguous().view(torch.float8_e4m3fn), torch.tensor(SCALES).view(-1, 1, 1)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN stays NaN (codes 0x7f, 0xff; NaN scales)"
    bits = torch.int16 if want.dtype.itemsize == 2 else torch.int32
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])  # signed zeros too


# The native kernel makes bfloat16, float16 and float32 (other dtypes take the torch passes).
CASES = [
    (impl, dtype)
    for impl in IMPLS
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not impl.startswith("native") or dtype in NATIVE_DTYPES
]


@pytest.mark.parametrize(("impl", "dtype"), CASES)
@pytest.mark.parametrize("hidden", [256, 300])  # 300: a scalar tail after the 64-code steps
def test_bit_exact_for_every_code_and_scale(impl: str, dtype: torch.dtype, hidden: int) -> None:
    fp8, scales = every_code_under_every_scale(hidden)
    for per_row in (scales, scales.expand(-1, 2, 1).contiguous() * 3):  # [T,1,1] and [T,L,1]
        want = fp8_cpu.reference(fp8, per_row, torch.empty(fp8.shape, dtype=dtype))
        got = IMPLS[impl](fp8, per_row, torch.empty(fp8.shape, dtype=dtype))
        assert_bit_exact(got, want)


@pytest.mark.parametrize("level", fp8_cpu.native_levels())
def test_native_reads_strided_codes_and_selected_layers(level: int) -> None:
    """A strided view of the codes (e.g. every other layer) and its per-layer scales."""
    x = torch.randn(40, 4, 192).bfloat16() * torch.logspace(-3, 3, 4).view(1, 4, 1)
    q, s = quantize(x)
    picked_q, picked_s = q[:, ::2], s[:, ::2]
    assert not picked_q.is_contiguous()
    out = torch.empty(picked_q.shape, dtype=torch.bfloat16)
    want = fp8_cpu.reference(picked_q, picked_s, torch.empty_like(out))
    assert_bit_exact(fp8_cpu.native_into(picked_q, picked_s, out, level=level), want)


def test_native_kernel_refuses_mismatched_buffers() -> None:
    native = fp8_cpu._native()
    codes = torch.zeros(4, 64, dtype=torch.uint8).numpy()
    values = torch.zeros(256).numpy()
    out = torch.zeros(4, 64, dtype=torch.int16).numpy()
    with pytest.raises(ValueError, match="scales must hold"):
        native.dequantize(codes, torch.zeros(3).numpy(), values, out, 64, 1, 0, -1)
    with pytest.raises(ValueError, match="codes must be rows x hidden"):
        native.dequantize(codes, torch.zeros(4).numpy(), values, out[:3], 64, 1, 0, -1)
    with pytest.raises(ValueError, match="values must hold"):
        native.dequantize(codes, torch.zeros(4).numpy(), values[:8], out, 64, 1, 0, -1)
    with pytest.raises(ValueError, match="kind must be"):
        native.dequantize(codes, torch.zeros(4).numpy(), values, out, 64, 1, 7, -1)


def test_this_environment_builds_the_native_kernel() -> None:
    """``make install`` compiles the extension (a C compiler is there): the suite runs it.

    Without a compiler the package installs without it and ``kernel()`` says "torch
    passes" (the other tests above still check that path).
    """
    for dtype in NATIVE_DTYPES:
        assert fp8_cpu.kernel(str(dtype)).startswith("native"), dtype
    assert fp8_cpu.kernel("torch.float64") == "torch passes"


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("level", fp8_cpu.native_levels())
def test_bit_exact_under_random_scale_bit_patterns(level: int, dtype: torch.dtype) -> None:
    """2,000 float32 scales drawn as raw bit patterns (every magnitude, sign, subnormal,
    infinity and NaN payload), all 256 codes under each, at every level."""
    gen = torch.Generator().manual_seed(level)
    bits = torch.randint(-(2**31), 2**31, (2000,), generator=gen, dtype=torch.int64)
    scales = bits.to(torch.int32).view(torch.float32).view(-1, 1, 1)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2000, 1, 1)
    fp8 = codes.view(torch.float8_e4m3fn)
    want = fp8_cpu.reference(fp8, scales, torch.empty(fp8.shape, dtype=dtype))
    assert_bit_exact(fp8_cpu.native_into(fp8, scales, torch.empty_like(want), level=level), want)


def test_native_kernel_refuses_a_scale_group_size_that_would_overflow() -> None:
    native = fp8_cpu._native()
    codes = torch.zeros(2, 64, dtype=torch.uint8).numpy()
    out = torch.zeros(2, 64, dtype=torch.int16).numpy()
    values = torch.zeros(256).numpy()
    with pytest.raises(ValueError, match="scales must hold"):
        native.dequantize(codes, torch.zeros(2).numpy(), values, out, 64, 2**63 - 1, 0, -1)
    native.dequantize(codes, torch.zeros(1).numpy(), values, out, 64, 2**63 - 1, 0, -1)


def test_other_float8_types_and_scalar_scales_take_the_definition() -> None:
    """e5m2 codes mean other values (the table is e4m3's); a 0-dim scale broadcasts."""
    x = torch.randn(8, 2, 96)
    e5m2 = x.to(torch.float8_e5m2)
    scales = torch.rand(8, 2, 1) + 0.5
    out = fp8_cpu.dequantize_into(e5m2, scales, torch.empty(x.shape, dtype=torch.bfloat16))
    assert torch.equal(out, (e5m2.float() * scales).to(torch.bfloat16))
    e4m3 = x.to(torch.float8_e4m3fn)
    scalar = torch.tensor(0.25)
    out = fp8_cpu.dequantize_into(e4m3, scalar, torch.empty(x.shape, dtype=torch.bfloat16))
    assert torch.equal(out, (e4m3.float() * scalar).to(torch.bfloat16))
