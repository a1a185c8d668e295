"""Read LLM hidden states written by vLLM's ``extract_hidden_states`` into training loops.

Quick start::

    from hidden_state_reader import HiddenStateReader

    for token_ids, hidden_states in HiddenStateReader("/data/hs"):
        ...
"""

from hidden_state_reader.collate import PackCollate, PadCollate, pack_collate, pad_collate
from hidden_state_reader.dataset import HiddenStateDataset
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
from hidden_state_reader.load import LoadOptions, load_sample
from hidden_state_reader.loader import HiddenStateLoader
from hidden_state_reader.reader import HiddenStateReader
from hidden_state_reader.sample import Sample
from hidden_state_reader.sharding import distributed_context
from hidden_state_reader.stats import ReaderStats

__version__ = "0.1.0"

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
