"""Read LLM hidden states written by vLLM's ``extract_hidden_states`` into training loops.

Quick start::

    from hidden_state_reader import HiddenStateReader

    for token_ids, hidden_states in HiddenStateReader("/data/hs"):
        ...

The names below are imported on first use (PEP 562), so importing a submodule such as
``hidden_state_reader.format`` does not pull in ``torch.utils.data`` or anything else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hidden_state_reader.errors import (
        CorruptSampleError,
        FailedSampleError,
        HiddenStateError,
        IncompleteSampleError,
        LockTimeoutError,
        PathOutsideRootError,
        SampleError,
        StaleLockError,
        WaitCancelledError,
    )
    from hidden_state_reader.format import read_header, write_sample
    from hidden_state_reader.options import LoadOptions
    from hidden_state_reader.read.counters import ReaderStats
    from hidden_state_reader.reader import HiddenStateReader
    from hidden_state_reader.sample.load import load_sample
    from hidden_state_reader.sample.sample import Sample
    from hidden_state_reader.training.collate import (
        PackCollate,
        PadCollate,
        pack_collate,
        pad_collate,
    )
    from hidden_state_reader.training.dataset import HiddenStateDataset
    from hidden_state_reader.training.loader import HiddenStateLoader
    from hidden_state_reader.training.sharding import distributed_context

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "CorruptSampleError": "hidden_state_reader.errors",
    "FailedSampleError": "hidden_state_reader.errors",
    "HiddenStateDataset": "hidden_state_reader.training.dataset",
    "HiddenStateError": "hidden_state_reader.errors",
    "HiddenStateLoader": "hidden_state_reader.training.loader",
    "HiddenStateReader": "hidden_state_reader.reader",
    "IncompleteSampleError": "hidden_state_reader.errors",
    "LoadOptions": "hidden_state_reader.options",
    "LockTimeoutError": "hidden_state_reader.errors",
    "PackCollate": "hidden_state_reader.training.collate",
    "PadCollate": "hidden_state_reader.training.collate",
    "PathOutsideRootError": "hidden_state_reader.errors",
    "ReaderStats": "hidden_state_reader.read.counters",
    "Sample": "hidden_state_reader.sample.sample",
    "SampleError": "hidden_state_reader.errors",
    "StaleLockError": "hidden_state_reader.errors",
    "WaitCancelledError": "hidden_state_reader.errors",
    "distributed_context": "hidden_state_reader.training.sharding",
    "load_sample": "hidden_state_reader.sample.load",
    "pack_collate": "hidden_state_reader.training.collate",
    "pad_collate": "hidden_state_reader.training.collate",
    "read_header": "hidden_state_reader.format",
    "write_sample": "hidden_state_reader.format",
}

__all__ = [
    "CorruptSampleError",
    "FailedSampleError",
    "HiddenStateDataset",
    "HiddenStateError",
    "HiddenStateLoader",
    "HiddenStateReader",
    "IncompleteSampleError",
    "LoadOptions",
    "LockTimeoutError",
    "PackCollate",
    "PadCollate",
    "PathOutsideRootError",
    "ReaderStats",
    "Sample",
    "SampleError",
    "StaleLockError",
    "WaitCancelledError",
    "__version__",
    "distributed_context",
    "load_sample",
    "pack_collate",
    "pad_collate",
    "read_header",
    "write_sample",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
