"""Reader options as typed values: ``LoadOptions`` (file -> tensors) and ``ReaderOptions``.

``ReaderOptions`` is the keyword options of ``HiddenStateReader`` as one typed value.

``HiddenStateDataset`` takes them as keyword arguments (``**reader_kwargs``) and keeps
them as a ``ReaderOptions``, so an unknown option fails at construction with a
``TypeError`` and every option has one type and one default, the reader's. ``follow``
and ``claim`` are not among them: the dataset decides those itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:
    import torch

OnError = Literal["skip", "raise"]
OnConsumed = Literal["keep", "delete", "move"]


@dataclass(frozen=True)
class LoadOptions:
    """How samples are turned into tensors.

    Attributes:
        layers: Positions along the layer axis to keep (e.g. ``[-1]`` for the last).
        layer_ids: Captured layer ids to keep (needs ``layer_ids`` metadata).
        dtype: Convert ``hidden_states`` to this dtype.
        pin_memory: Read into page-locked memory (faster host-to-GPU copies).
        verify_checksum: Check the writer's CRC32 when the file has one (our writers
            record one by default). Off by default: it is a second pass over every byte
            (docs/reader.md, "Integrity"); ``hidden-state verify --checksums`` checks a
            whole directory on demand.
        mmap: Map files of ``MMAP_MIN_BYTES`` or more instead of copying them.
        raw_fp8: Give fp8 files' ``hidden_states`` as stored (float8_e4m3fn) with
            ``Sample.hidden_states_scales``, to dequantize later (e.g. on the GPU with
            ``format.fp8.dequantize``); ``dtype`` then applies to other files only. By
            default fp8 files are dequantized on read (on the CPU) to ``dtype``, else
            to the ``model_dtype`` the writer recorded.
        device: Put the sample's tensors on this torch device (``"cuda"``,
            ``"cuda:1"``, ...) as stored, then convert there: fp8 files cross to the
            device as fp8 plus scales (half the bytes of bf16) and are dequantized on
            it. None (the default): the CPU.
    """

    layers: Sequence[int] | None = None
    layer_ids: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    pin_memory: bool = False
    verify_checksum: bool = False
    mmap: bool = True
    raw_fp8: bool = False
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and self.layer_ids is not None:
            raise ValueError("pass either layers (positions) or layer_ids, not both")
        if self.device is not None:
            from hidden_state_reader.sample.placement import check_device

            check_device(self.device)


@dataclass(frozen=True)
class ReaderOptions(LoadOptions):
    """Keyword options of ``HiddenStateReader`` other than ``follow`` and ``claim``.

    Each attribute is the reader argument of the same name, with the same default;
    see ``HiddenStateReader`` for what it does. The ``LoadOptions`` fields (layers,
    dtype, memory) are inherited.
    """

    idle_timeout: float | None = None
    max_samples: int | None = None
    claim_group: str = "default"
    on_consumed: OnConsumed = "keep"
    done_dir: str | os.PathLike[str] | None = None
    on_error: OnError = "skip"
    lock_timeout: float | None = 600.0
    names: Sequence[str] | None = None
    watch: str = "auto"
    rescan_interval: float = 30.0
    poll_interval: float = 1.0
    orphan_grace: float = GRACE

    def as_kwargs(self, **changes: Any) -> dict[str, Any]:
        """The options as ``HiddenStateReader`` keyword arguments, with ``changes`` applied."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(changes)
        return out
