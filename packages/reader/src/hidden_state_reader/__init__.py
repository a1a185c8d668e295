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
    # What type checkers and IDEs see (they cannot follow ``__getattr__``): ``_EXPORTS``
    # below, as imports; tests/reader/test_imports.py keeps the two equal.
    from hidden_state_reader.errors import CorruptSampleError as CorruptSampleError
    from hidden_state_reader.errors import FailedSampleError as FailedSampleError
    from hidden_state_reader.errors import HiddenStateError as HiddenStateError
    from hidden_state_reader.errors import IncompleteSampleError as IncompleteSampleError
    from hidden_state_reader.errors import LockTimeoutError as LockTimeoutError
    from hidden_state_reader.errors import PathOutsideRootError as PathOutsideRootError
    from hidden_state_reader.errors import SampleError as SampleError
    from hidden_state_reader.errors import StaleLockError as StaleLockError
    from hidden_state_reader.errors import WaitCancelledError as WaitCancelledError
    from hidden_state_reader.files.header import read_header as read_header
    from hidden_state_reader.files.publish import write_sample as write_sample
    from hidden_state_reader.kernels.fp8 import dequantize as dequantize
    from hidden_state_reader.options import LoadOptions as LoadOptions
    from hidden_state_reader.read.counters import ReaderStats as ReaderStats
    from hidden_state_reader.reader import HiddenStateReader as HiddenStateReader
    from hidden_state_reader.sample.load import load_sample as load_sample
    from hidden_state_reader.sample.sample import Sample as Sample
    from hidden_state_reader.training.collate import PackCollate as PackCollate
    from hidden_state_reader.training.collate import PadCollate as PadCollate
    from hidden_state_reader.training.collate import pack_collate as pack_collate
    from hidden_state_reader.training.collate import pad_collate as pad_collate
    from hidden_state_reader.training.dataset import HiddenStateDataset as HiddenStateDataset
    from hidden_state_reader.training.loader import HiddenStateLoader as HiddenStateLoader
    from hidden_state_reader.training.sharding import distributed_context as distributed_context

__version__ = "0.1.0"

# The public names, each once, under the module that defines it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "hidden_state_reader.errors": (
        "CorruptSampleError",
        "FailedSampleError",
        "HiddenStateError",
        "IncompleteSampleError",
        "LockTimeoutError",
        "PathOutsideRootError",
        "SampleError",
        "StaleLockError",
        "WaitCancelledError",
    ),
    "hidden_state_reader.files.header": ("read_header",),
    "hidden_state_reader.files.publish": ("write_sample",),
    "hidden_state_reader.kernels.fp8": ("dequantize",),
    "hidden_state_reader.options": ("LoadOptions",),
    "hidden_state_reader.read.counters": ("ReaderStats",),
    "hidden_state_reader.reader": ("HiddenStateReader",),
    "hidden_state_reader.sample.load": ("load_sample",),
    "hidden_state_reader.sample.sample": ("Sample",),
    "hidden_state_reader.training.collate": (
        "PackCollate",
        "PadCollate",
        "pack_collate",
        "pad_collate",
    ),
    "hidden_state_reader.training.dataset": ("HiddenStateDataset",),
    "hidden_state_reader.training.loader": ("HiddenStateLoader",),
    "hidden_state_reader.training.sharding": ("distributed_context",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(["__version__", *_MODULE_OF])


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
