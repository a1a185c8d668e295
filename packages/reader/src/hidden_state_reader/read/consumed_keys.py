"""Reading and writing consumed-key records (the format is ``format/consumed.py``).

A consumer that deletes or moves a sample named by an idempotency key records the key
first (``record_consumed``), so a retry of the key, by any engine on any host, writes
nothing while the record lives (``is_consumed``), and a copy published anyway (a retry
that was in flight when the first copy was consumed) is dropped by the consumers
(``drops_copy``). ``expired_records`` lists what ``hidden-state clean`` may remove.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

from hidden_state_reader.files.atomic import write_atomic
from hidden_state_reader.files.identity import process_label
from hidden_state_reader.format.consumed import (
    CONSUMED_DIR,
    MAX_RECORD_BYTES,
    ConsumedRecord,
    decode_record,
    encode_record,
    record_path,
)
from hidden_state_reader.format.header import Meta


def sample_key(metadata: Mapping[str, str]) -> str | None:
    """The idempotency key a sample's header records (None: the sample has none)."""
    return metadata.get(Meta.IDEMPOTENCY_KEY)


def new_record(retention: float, action: str) -> ConsumedRecord:
    """The record of a key consumed now by this process, remembered for ``retention`` s."""
    now = time.time()
    return ConsumedRecord(now, now + retention, action, process_label())


def record_consumed(root: str, name: str, retention: float, action: str) -> None:
    """Record that the keyed sample ``name`` of ``root`` is consumed, atomically.

    Written under a temporary name and renamed into place, so a record is never seen
    half written; a later consumption of the same key replaces it.

    Args:
        root: The storage directory.
        name: The sample's file name.
        retention: Seconds the key is remembered from now.
        action: ``delete`` or ``move``.

    Raises:
        OSError: The record cannot be written (the caller then keeps the sample).
    """
    record = new_record(retention, action)
    final = record_path(root, name)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    write_atomic(final, encode_record(record))


def read_record(root: str, name: str) -> ConsumedRecord | None:
    """The record of ``name`` (None: none, or unreadable)."""
    try:
        with open(record_path(root, name), "rb") as f:
            return decode_record(f.read(MAX_RECORD_BYTES))
    except OSError:
        return None


def is_consumed(root: str, name: str, now: float | None = None) -> bool:
    """Whether a live record says the keyed sample ``name`` was consumed."""
    record = read_record(root, name)
    return record is not None and record.live(time.time() if now is None else now)


def drops_copy(root: str, name: str, metadata: Mapping[str, str]) -> bool:
    """Whether a consumer must drop this sample: a copy of a key already consumed."""
    return sample_key(metadata) is not None and is_consumed(root, name)


def expired_records(root: str, now: float, older_than: float | None = None) -> Iterator[str]:
    """Paths of the records that may go: expired, unreadable, or consumed before a cut-off.

    Args:
        root: The storage directory.
        now: The current Unix time.
        older_than: Also records consumed at least this many seconds ago (None: only
            expired ones).
    """
    directory = os.path.join(root, CONSUMED_DIR)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in sorted(names):
        path = os.path.join(directory, name)
        record = read_record(root, name)
        if record is None:
            # Unreadable or a dead consumer's temporary file: gone once it is a minute old.
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime >= 60:
                    yield path
            continue
        cut = older_than is not None and now - record.consumed_at >= older_than
        if cut or not record.live(now):
            yield path
