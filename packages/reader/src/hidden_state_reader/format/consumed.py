"""Consumed-key records: a keyed sample that a consumer removed is remembered for a while.

A sample named by an idempotency key (``idempotency.py``; its header records the key as
``Meta.IDEMPOTENCY_KEY``) may be retried by its client after a consumer has deleted or
moved it. So that the retry writes nothing, the consumer first leaves a record
``<root>/.consumed/NAME`` (``NAME`` the sample's file name), then removes the sample.
The record is a small JSON object: when the sample was consumed, until when the key is
remembered (the consumer's ``consumed_key_retention``), by which host and process, and
how (``delete`` or ``move``). A writer treats a key whose record has not expired as
written; a consumer drops a copy of such a key (a retry published after the first was
consumed) instead of yielding it; ``hidden-state clean`` removes expired records.

The names and the encoding live here; the reading and writing in
``hidden_state_reader.read.consumed_keys``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

CONSUMED_DIR = ".consumed"
DEFAULT_RETENTION = 7 * 24 * 3600.0
"""Seconds a consumed key is remembered unless the consumer says otherwise (7 days)."""
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True)
class ConsumedRecord:
    """What a consumed-key record says.

    Attributes:
        consumed_at: Unix time the consumer removed the sample.
        expires_at: Unix time after which the key is forgotten (a retry writes again).
        action: ``delete`` or ``move``.
        by: ``host:pid`` of the consumer.
    """

    consumed_at: float
    expires_at: float
    action: str = ""
    by: str = ""

    def live(self, now: float) -> bool:
        """Whether the key is still remembered at ``now``."""
        return now < self.expires_at


def record_path(root: str, name: str) -> str:
    """The record of the consumed sample ``name`` (a file name in ``root``)."""
    return os.path.join(root, CONSUMED_DIR, name)


def check_retention(value: object, what: str = "consumed_key_retention") -> float:
    """A retention in seconds (0: remember nothing), or ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{what} must be 0 (remember no consumed key) or a positive number of seconds, "
            f"got {value!r}"
        )
    return float(value)


def encode_record(record: ConsumedRecord) -> bytes:
    """The record's file content (JSON)."""
    doc = {
        "consumed_at": record.consumed_at,
        "expires_at": record.expires_at,
        "action": record.action,
        "by": record.by,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_record(raw: bytes) -> ConsumedRecord | None:
    """The record in ``raw``; None when it is not one (empty, cut, foreign)."""
    try:
        doc = json.loads(raw[:MAX_RECORD_BYTES])
        return ConsumedRecord(
            float(doc["consumed_at"]),
            float(doc["expires_at"]),
            str(doc.get("action", "")),
            str(doc.get("by", "")),
        )
    except (ValueError, TypeError, KeyError):
        return None
