"""On-disk format v1: file names, safetensors header, lock protocol, atomic publication.

This is the single source of truth for the format; the connector imports it.
See ``docs/format.md``.
"""

from hidden_state_reader.format.header import (
    FORMAT_VERSION,
    HIDDEN_STATES,
    TOKEN_IDS,
    Meta,
    SampleHeader,
    encode_header,
    read_header,
    read_header_fd,
    sample_metadata,
)
from hidden_state_reader.format.idempotency import keyed_sample_name
from hidden_state_reader.format.lockfile import (
    LockState,
    LockStatus,
    SharedLock,
    WriterLock,
    probe,
    read_status,
)
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
    open_dir_beneath,
    resolve_inside,
    safe_component,
    sample_key,
    temp_path,
)
from hidden_state_reader.format.publish import (
    SampleFileWriter,
    has_nonfinite,
    tensor_bytes,
    write_sample,
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
    "Kind",
    "LockState",
    "LockStatus",
    "Meta",
    "SampleFileWriter",
    "SampleHeader",
    "SharedLock",
    "TensorInfo",
    "WriterLock",
    "check_tags",
    "classify",
    "encode_header",
    "has_nonfinite",
    "keyed_sample_name",
    "lock_path",
    "natural_key",
    "open_dir_beneath",
    "probe",
    "read_header",
    "read_header_fd",
    "read_status",
    "resolve_inside",
    "safe_component",
    "sample_key",
    "sample_metadata",
    "sample_tags",
    "tag_metadata",
    "temp_path",
    "tensor_bytes",
    "write_sample",
]
