"""The reader's options, defined once: ``LoadOptions`` (file -> tensors) and ``ReaderOptions``.

``ReaderOptions`` is every keyword option of ``HiddenStateReader`` as one typed value:
the reader's keyword-only parameters build one (a test keeps their names, types and
defaults equal to its fields), ``HiddenStateDataset`` keeps its options as one, and each
backend reads its settings from it. An unknown option fails with a ``TypeError``, a bad
value with a ``ValueError`` naming the option, when the options are made.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from hidden_state_reader.format.consumed import DEFAULT_RETENTION, check_retention
from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:
    import torch

OnError = Literal["skip", "raise"]
OnConsumed = Literal["keep", "delete", "move"]
Watch = Literal["auto", "inotify", "poll"]

ON_ERROR: tuple[str, ...] = get_args(OnError)
ON_CONSUMED: tuple[str, ...] = get_args(OnConsumed)
WATCH_MODES: tuple[str, ...] = get_args(Watch)


@dataclass(frozen=True)
class LoadOptions:
    """How samples are turned into tensors.

    Attributes:
        layers: Keep only these positions of the layer axis (e.g. ``[-1]`` for the last).
        layer_ids: Keep only these captured layer ids (needs the writer's ``layer_ids``
            metadata).
        dtype: Convert hidden states to this dtype.
        pin_memory: Read into page-locked memory (faster host-to-GPU copies).
        verify_checksum: Check the writer's CRC32 when the file has one (our writers
            record one by default). Off by default: it is a second pass over every byte
            (docs/reader.md, "Integrity"); ``hidden-state verify --checksums`` checks a
            whole directory on demand.
        mmap: Map files of 1 MiB (``MMAP_MIN_BYTES``) or more instead of copying them
            (faster; the tensors stay valid after the file is deleted). Turn off if your
            writer rewrites published files in place.
        raw_fp8: Give files stored in fp8 as stored (``hidden_states`` float8_e4m3fn plus
            ``Sample.hidden_states_scales``) instead of dequantizing them on the CPU;
            dequantize on the GPU with ``hidden_state_reader.dequantize``.
            ``dtype`` then applies to other files only. By default fp8 files are
            dequantized to ``dtype``, else to the ``model_dtype`` the writer recorded.
        device: Put the sample's tensors on this torch device (``"cuda"``,
            ``"cuda:1"``, ...) as stored, then convert there: fp8 files cross to the
            device as fp8 plus scales (half the bytes of bf16; pinned staging for CUDA)
            and are dequantized on it. None (the default): the CPU.
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
    """The keyword options of ``HiddenStateReader`` (and of ``HiddenStateDataset``).

    One field per keyword-only parameter of ``HiddenStateReader.__init__``, same name,
    type and default, documented in its ``Args``; the ``LoadOptions`` fields (layers,
    dtype, memory) are inherited.
    """

    follow: bool = False
    idle_timeout: float | None = None
    max_samples: int | None = None
    claim: bool = False
    claim_group: str = "default"
    claim_steal_after: float = 2.0
    on_consumed: OnConsumed = "keep"
    done_dir: str | os.PathLike[str] | None = None
    on_error: OnError = "skip"
    lock_timeout: float | None = 600.0
    names: Sequence[str] | None = None
    watch: Watch = "auto"
    rescan_interval: float = 30.0
    poll_interval: float = 1.0
    orphan_grace: float = GRACE
    consumed_key_retention: float = DEFAULT_RETENTION

    def __post_init__(self) -> None:
        super().__post_init__()
        check_retention(self.consumed_key_retention)
        for option, value, allowed in (
            ("on_consumed", self.on_consumed, ON_CONSUMED),
            ("on_error", self.on_error, ON_ERROR),
            ("watch", self.watch, WATCH_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"{option} must be one of {allowed}, got {value!r}")
        if not self.claim_steal_after > 0:
            raise ValueError(
                f"claim_steal_after must be positive seconds, got {self.claim_steal_after!r}"
            )
        if self.follow and self.names is not None:
            raise ValueError("names= lists a fixed set of samples; it cannot be followed")

    def as_kwargs(self, **changes: Any) -> dict[str, Any]:
        """The options as ``HiddenStateReader`` keyword arguments, with ``changes`` applied."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(changes)
        return out

    def check_consumers(self, count: int, what: str) -> None:
        """Refuse ``count`` consumers that would each get every sample of a followed source.

        Args:
            count: How many consumers read with these options at once.
            what: What they are, for the message (``"ranks"``, ``"DataLoader workers"``).

        Raises:
            ValueError: ``follow`` without ``claim`` for more than one consumer.
        """
        if self.follow and not self.claim and count > 1:
            raise ValueError(
                f"follow mode with claim=False on {count} {what} would deliver every "
                "sample to each of them; use claim=True (the default in follow mode)"
            )
