"""Consumed-key records in the store: ``PREFIX/consumed/NAME`` (``format.store_keys``).

The store's half of ``read.consumed_keys``, with the same JSON record
(``format/consumed.py``): a deleting store reader puts it before it removes a keyed
sample (``record_consumed``); a producer publishes nothing for a name whose record is
live, and the connector's scheduler answers such a retry "existed" (``written``); a
copy published anyway (a retry in flight when the first was consumed) is dropped by
the readers (``store.key_memory``). The store cannot list keys: ``expired_records``
finds the records through the names the producers' commit logs announced.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from hidden_state_reader.format.consumed import ConsumedRecord, decode_record, encode_record
from hidden_state_reader.format.store_keys import consumed_key, data_key
from hidden_state_reader.read.consumed_keys import new_record
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.follow import CommitLog

_BATCH = 512  # keys per ``batch_is_exist`` when scanning


def record_consumed(client: StoreClient, name: str, retention: float) -> None:
    """Record that the keyed sample ``name`` is consumed (deleted), for ``retention`` s.

    A put keeps an existing value (Mooncake's rule), so an older record is removed
    first: the new record, with its own expiry, replaces it.

    Raises:
        StoreError: The record cannot be put (the caller then keeps the sample).
    """
    key = consumed_key(client.settings.prefix, name)
    client.remove(key)
    client.put(key, encode_record(new_record(retention, "delete")))


def read_record(client: StoreClient, name: str) -> ConsumedRecord | None:
    """The record of ``name`` (None: none, or not a record)."""
    raw = client.get(consumed_key(client.settings.prefix, name))
    return None if raw is None else decode_record(raw)


def is_consumed(client: StoreClient, name: str, now: float | None = None) -> bool:
    """Whether a live record says the keyed sample ``name`` was consumed."""
    if not client.exists([consumed_key(client.settings.prefix, name)])[0]:
        return False
    record = read_record(client, name)
    return record is not None and record.live(time.time() if now is None else now)


def written(client: StoreClient, name: str) -> str | None:
    """Why a keyed sample ``name`` needs no writing: ``"published"``, ``"consumed"``, None.

    One ``batch_is_exist`` for both keys; the record is read only when it exists.
    """
    prefix = client.settings.prefix
    data, record = client.exists([data_key(prefix, name), consumed_key(prefix, name)])
    if data:
        return "published"
    if record and is_consumed(client, name):
        return "consumed"
    return None


def announced_names(client: StoreClient) -> list[str]:
    """Every name the producers' commit logs announce (each once, in log order)."""
    log = CommitLog(client, hole_grace=0.0)
    seen: dict[str, None] = {}
    while records := log.poll():
        for _key, record in records:
            seen.setdefault(record.name, None)
    return list(seen)


def expired_records(
    client: StoreClient, now: float, older_than: float | None = None
) -> Iterator[tuple[str, str]]:
    """``(name, key)`` of the records that may go: expired, not records, or cut off.

    Args:
        client: The store (its prefix).
        now: The current Unix time.
        older_than: Also records consumed at least this many seconds ago (None: only
            expired ones).
    """
    prefix = client.settings.prefix
    names = announced_names(client)
    for start in range(0, len(names), _BATCH):
        chunk = names[start : start + _BATCH]
        present = client.exists([consumed_key(prefix, n) for n in chunk])
        for name, there in zip(chunk, present, strict=True):
            if not there:
                continue
            record = read_record(client, name)
            cut = (
                record is not None
                and older_than is not None
                and now - record.consumed_at >= older_than
            )
            if record is None or cut or not record.live(now):
                yield name, consumed_key(prefix, name)
