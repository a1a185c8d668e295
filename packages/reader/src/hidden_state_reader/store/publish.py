"""The producer's half of the store protocol: a slot, then data (or failure), then commit.

``StorePublisher.publish`` stores a finished sample file's bytes hard-pinned under
``data/NAME`` and only then appends a ``CommitRecord`` to its slot's log; ``fail``
does the same with ``failed/NAME``. A reader that finds a commit record therefore finds
the complete object it announces, and a producer killed at any point leaves either no
record or a complete one (Mooncake makes an object visible only once its put ends).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import threading
import time
import uuid

from hidden_state_reader.errors import SampleError
from hidden_state_reader.files.identity import process_record
from hidden_state_reader.format.header import Meta, SampleHeader, parse_header
from hidden_state_reader.format.store_keys import (
    CommitRecord,
    data_key,
    failed_key,
    log_key,
    producer_key,
)
from hidden_state_reader.kernels import layouts
from hidden_state_reader.store.client import StoreClient, StoreError
from hidden_state_reader.store.consumed import written

log = logging.getLogger(__name__)

MAX_SLOTS = 4096


class StorePublisher:
    """Publishes samples into the store under one producer slot.

    Args:
        client: A joined store client.
        full_timeout: Seconds a put waits for room in a full store before the sample
            fails (the back-pressure bound).
        instance: Recorded in the slot's owner record (e.g. the engine's instance id).

    Raises:
        StoreError: No slot could be taken.
    """

    def __init__(
        self, client: StoreClient, *, full_timeout: float = 60.0, instance: str = ""
    ) -> None:
        self.client = client
        self.prefix = client.settings.prefix
        self.full_timeout = full_timeout
        self._lock = threading.Lock()
        self._next_seq = 0
        self.slot = self._take_slot(instance)

    def _take_slot(self, instance: str) -> int:
        owner = {"instance": instance, **process_record()}
        token = json.dumps({**owner, "started": time.time(), "nonce": uuid.uuid4().hex}).encode()
        for slot in range(MAX_SLOTS):
            if self.client.put_first(producer_key(self.prefix, slot), token) == token:
                return slot
        raise StoreError(f"{self.prefix}: all {MAX_SLOTS} producer slots are taken")

    def _commit(self, record: CommitRecord) -> None:
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        key = log_key(self.prefix, self.slot, seq)
        self.client.put(key, record.encode(), full_timeout=self.full_timeout)

    def publish(self, name: str, data: bytes | memoryview | mmap.mmap) -> None:
        """Store one complete sample file's bytes, then announce them.

        A name whose bytes are in the store already (a retried request with the same
        idempotency key) is left as it is and not announced again: one sample per name.
        Nor is a name a reader consumed within its key's retention written again
        (``store.consumed``).

        Raises:
            SampleError: The bytes are not a complete sample (nothing is stored).
            StoreFullError: The store stayed full for ``full_timeout`` seconds.
            StoreError: The store failed.
        """
        key = data_key(self.prefix, name)
        header = parse_sample_header(key, data)
        why = written(self.client, name)
        if why == "published":
            log.info("%s is in the store already (a retry?): kept, not announced again", name)
            return
        if why == "consumed":
            log.info("%s was consumed within its key's retention: not written again", name)
            return
        self.client.put(key, data, full_timeout=self.full_timeout)
        crc = header.metadata.get(Meta.CRC32, "")
        self._commit(CommitRecord(name, True, header.file_size, crc))

    def fail(self, name: str, reason: str, **detail: object) -> None:
        """Record that ``name`` will never come, and why (best effort: logged if it fails)."""
        try:
            body = json.dumps({"reason": reason, **detail}, default=str).encode()
            self.client.put(failed_key(self.prefix, name), body, full_timeout=self.full_timeout)
            self._commit(CommitRecord(name, False))
        except StoreError as exc:
            log.warning("%s: cannot record failure %r in the store: %s", name, reason, exc)


def parse_sample_header(key: str, data: bytes | memoryview | mmap.mmap) -> SampleHeader:
    """Validate a sample's bytes as a complete file (``format.header.parse_header``).

    Raises:
        SampleError: Truncated or malformed bytes (naming ``key``).
    """
    view = memoryview(data)
    if view.nbytes < 8:
        raise SampleError(key, f"only {view.nbytes} bytes, shorter than the header prefix")
    (length,) = struct.unpack("<Q", view[:8])
    if 8 + length > view.nbytes:
        raise SampleError(key, f"truncated inside the header ({view.nbytes} of {8 + length})")
    return parse_header(key, bytes(view[8 : 8 + length]), view.nbytes, layouts)


def publish_file(publisher: StorePublisher, name: str, path: str) -> None:
    """Publish a finished sample file (mapped, not copied), then remove it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise SampleError(path, "empty file")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            publisher.publish(name, mapped)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
