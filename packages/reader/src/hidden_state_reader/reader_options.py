"""``ReaderOptions``: the keyword options of ``HiddenStateReader``, as one typed value.

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

from hidden_state_reader.states import GRACE

if TYPE_CHECKING:
    import torch

OnError = Literal["skip", "raise"]
OnConsumed = Literal["keep", "delete", "move"]


@dataclass(frozen=True)
class ReaderOptions:
    """Keyword options of ``HiddenStateReader`` other than ``follow`` and ``claim``.

    Each attribute is the reader argument of the same name, with the same default;
    see ``HiddenStateReader`` for what it does.
    """

    idle_timeout: float | None = None
    max_samples: int | None = None
    claim_group: str = "default"
    on_consumed: OnConsumed = "keep"
    done_dir: str | os.PathLike[str] | None = None
    on_error: OnError = "skip"
    lock_timeout: float | None = 600.0
    names: Sequence[str] | None = None
    layers: Sequence[int] | None = None
    layer_ids: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    pin_memory: bool = False
    verify_checksum: bool = False
    mmap: bool = True
    raw_fp8: bool = False
    watch: str = "auto"
    rescan_interval: float = 30.0
    poll_interval: float = 1.0
    orphan_grace: float = GRACE

    def as_kwargs(self, **changes: Any) -> dict[str, Any]:
        """The options as ``HiddenStateReader`` keyword arguments, with ``changes`` applied."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(changes)
        return out
