"""Tensor dtypes of the format, and where one tensor lives in a file (``TensorInfo``).

Shared by the header (``header``, which parses and validates) and the optional tensors
that check themselves (``loss_mask``); the torch dtypes are looked up on first use, so
importing the format imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from hidden_state_reader.format import fp8

if TYPE_CHECKING:
    import torch

# Element size of every dtype this format accepts. The format itself needs no torch, so
# importing it imports no torch either; the torch dtypes are looked up on first use.
DTYPE_SIZES: dict[str, int] = {
    **{"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4},
    "U8": 1,  # loss_mask (format/loss_mask.py)
    "BOOL": 1,
    fp8.FP8_DTYPE: 1,
}
HIDDEN_DTYPES = frozenset({"BF16", "F16", "F32", fp8.FP8_DTYPE})
TOKEN_DTYPES = frozenset({"I64", "I32"})


@cache
def dtype_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """``(safetensors name -> torch dtype, torch dtype -> safetensors name)``."""
    import torch

    by_name = {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        fp8.FP8_DTYPE: torch.float8_e4m3fn,
    }
    return by_name, {v: k for k, v in by_name.items()}


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (safetensors name -> torch dtype) and ``DTYPE_NAMES`` (the reverse) stay
    # module attributes, built when first asked for (PEP 562).
    if name == "DTYPES":
        return dtype_tables()[0]
    if name == "DTYPE_NAMES":
        return dtype_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file, relative to the start of the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this tensor."""
        return dtype_tables()[0][self.dtype]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin
