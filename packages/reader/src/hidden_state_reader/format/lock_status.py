"""The lock-status schema of format v1: what a lock file says, as bytes and as values.

A writer's lock file ``NAME.safetensors.lock`` holds a small JSON object
``{"state": ..., **detail}``: ``writing`` with who writes (``files.identity``), or
``failed`` with a reason. vLLM's own connector leaves it empty. The reader's claim files
use the same encoding. Taking, holding and reading locks is the file protocol's work
(``hidden_state_reader.files.locks``); this module only names the states and encodes and
decodes the status.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

STATE_WRITING = "writing"
STATE_FAILED = "failed"
MAX_STATUS_BYTES = 4096


class LockState(enum.Enum):
    """What a non-blocking look at a lock file found."""

    ABSENT = "absent"
    FREE = "free"
    HELD = "held"


@dataclass(frozen=True)
class LockStatus:
    """The JSON status a writer left in a lock file (empty for vLLM-written locks)."""

    state: str | None
    detail: dict[str, Any]

    @property
    def failed(self) -> bool:
        """The writer gave up on this sample."""
        return self.state == STATE_FAILED

    @property
    def reason(self) -> str:
        """The writer's explanation, if any."""
        return str(self.detail.get("reason", ""))


# A small JSON object ``{"state": ..., **detail}`` in a locked file: the rule of the lock
# files, and also of the reader's claim files (``hidden_state_reader.read.claims``).


def encode_status(state: str, **detail: Any) -> bytes:
    """The JSON status ``{"state": state, **detail}``, at most ``MAX_STATUS_BYTES``."""
    return json.dumps({"state": state, **detail}, separators=(",", ":")).encode()[:MAX_STATUS_BYTES]


def decode_status(raw: bytes) -> LockStatus:
    """The status in a lock file's content ``raw``; ``state=None`` if empty or not one."""
    try:
        doc = json.loads(raw[:MAX_STATUS_BYTES]) if raw.strip() else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    state = doc.pop("state", None)
    return LockStatus(state if isinstance(state, str) else None, doc)
