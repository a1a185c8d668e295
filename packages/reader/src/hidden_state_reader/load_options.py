"""``LoadOptions``: how a sample file is turned into tensors (layers, dtype, memory)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoadOptions:
    """How samples are turned into tensors.

    Attributes:
        layers: Positions along the layer axis to keep (e.g. ``[-1]`` for the last).
        layer_ids: Captured layer ids to keep (needs ``layer_ids`` metadata).
        dtype: Convert ``hidden_states`` to this dtype.
        pin_memory: Read into page-locked memory (faster host-to-GPU copies).
        verify_checksum: Check the writer's CRC32 when the file has one.
        mmap: Map files of ``MMAP_MIN_BYTES`` or more instead of copying them.
        raw_fp8: Give fp8 files' ``hidden_states`` as stored (float8_e4m3fn) with
            ``Sample.hidden_states_scales``, to dequantize later (e.g. on the GPU with
            ``format.fp8.dequantize``); ``dtype`` then applies to other files only. By
            default fp8 files are dequantized on read (on the CPU) to ``dtype``, else
            to the ``model_dtype`` the writer recorded.
    """

    layers: Sequence[int] | None = None
    layer_ids: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    pin_memory: bool = False
    verify_checksum: bool = False
    mmap: bool = True
    raw_fp8: bool = False

    def __post_init__(self) -> None:
        if self.layers is not None and self.layer_ids is not None:
            raise ValueError("pass either layers (positions) or layer_ids, not both")
