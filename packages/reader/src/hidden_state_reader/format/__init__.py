"""On-disk format v1, the spec only: names, header bytes, tensors, lock status, tags.

This is the single source of truth for the format; the connector imports it. It does
no I/O and imports no OS mechanism (``tests/test_architecture_rules.py``): reading,
listing, locking and publishing files is ``hidden_state_reader.files``; fp8 arithmetic,
CRC and host memory are ``hidden_state_reader.kernels``. See ``docs/format.md``.
"""

from hidden_state_reader.format.header import (
    FORMAT_VERSION,
    HIDDEN_STATES,
    TOKEN_IDS,
    Meta,
    SampleHeader,
    encode_header,
    parse_header,
    sample_metadata,
)
from hidden_state_reader.format.idempotency import keyed_sample_name
from hidden_state_reader.format.lock_status import LockState, LockStatus
from hidden_state_reader.format.loss_mask import LOSS_MASK
from hidden_state_reader.format.names import (
    CLAIMS_DIR,
    DATA_SUFFIX,
    LOCK_SUFFIX,
    QUARANTINE_DIR,
    Kind,
    classify,
    lock_path,
    natural_key,
    safe_component,
    sample_key,
    temp_path,
)
from hidden_state_reader.format.speculation import (
    Acceptance,
    sample_acceptance,
    speculation_metadata,
)
from hidden_state_reader.format.tags import check_tags, sample_tags, tag_metadata
from hidden_state_reader.format.tensors import TensorInfo

__all__ = [
    "CLAIMS_DIR",
    "DATA_SUFFIX",
    "FORMAT_VERSION",
    "HIDDEN_STATES",
    "LOCK_SUFFIX",
    "LOSS_MASK",
    "QUARANTINE_DIR",
    "TOKEN_IDS",
    "Acceptance",
    "Kind",
    "LockState",
    "LockStatus",
    "Meta",
    "SampleHeader",
    "TensorInfo",
    "check_tags",
    "classify",
    "encode_header",
    "keyed_sample_name",
    "lock_path",
    "natural_key",
    "parse_header",
    "safe_component",
    "sample_acceptance",
    "sample_key",
    "sample_metadata",
    "sample_tags",
    "speculation_metadata",
    "tag_metadata",
    "temp_path",
]
