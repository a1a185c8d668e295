"""A thin, checked wrapper over ``mooncake.store.MooncakeDistributedStore``.

Mooncake's Python API reports trouble through return codes and empty results: a
``get`` of a missing key, or of an object larger than the client's local buffer,
returns empty bytes; a full store fails a put with -200 and nothing else happens. This
module turns each of those into a typed error naming the key and the setting to change,
and gives the two primitives the delivery protocol is built on: a hard-pinned put that
waits while the store is full (back-pressure), and a first-put-wins claim.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hidden_state_reader.errors import HiddenStateError
from hidden_state_reader.files.identity import host_name
from hidden_state_reader.kernels import host_memory
from hidden_state_reader.store.pool import ReceivePool

# Mooncake error codes (mooncake-store/include/types.h) this module tells apart.
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room (hard-pinned objects stay)
BUFFER_TOO_SMALL = -600  # the object does not fit the client's local buffer
NOT_FOUND = -704  # OBJECT_NOT_FOUND

_INSTALL_HINT = (
    "install the Mooncake Store client: `apt-get install -y libibverbs1` and "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` (CPU) or "
    "`pip install mooncake-transfer-engine` (CUDA)"
)


class StoreError(HiddenStateError):
    """The store refused or failed an operation; the message names the key and the code."""


class StoreUnavailableError(StoreError):
    """The ``mooncake`` package (or its ``libibverbs`` dependency) cannot be imported."""


class StoreFullError(StoreError):
    """No segment had room for an object for as long as the writer was willing to wait."""


@dataclass(frozen=True)
class StoreSettings:
    """Where the store is and how this process joins it.

    Attributes:
        master: ``host:port`` of ``mooncake_master``.
        prefix: Namespace of this data set's keys (``format.store_keys``).
        metadata_server: Transfer-engine metadata: ``P2PHANDSHAKE`` (no server), an
            ``http://host:port/metadata`` URL (the master's own with
            ``--enable_http_metadata_server``) or ``etcd://...``.
        local_hostname: Address other store clients reach this process at; default:
            this host's name resolved to an address.
        protocol: ``tcp`` or ``rdma``.
        device_names: RDMA devices (``rdma`` only).
        segment_bytes: Memory this process contributes to the store (0: none, objects
            live in other clients' segments and survive this process).
        buffer_bytes: This client's transfer buffer: the largest object it can put or get.
        claim_lease: Seconds a reader's claim survives without a lease renewal before
            another reader of its group takes it over (readers with ``claim=True`` only).
    """

    master: str
    prefix: str = "hs"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = ""
    protocol: str = "tcp"
    device_names: str = ""
    segment_bytes: int = 0
    buffer_bytes: int = 256 * 1024**2
    claim_lease: float = 30.0

    def hostname(self) -> str:
        """``local_hostname``, or this host's address when it is not set."""
        if self.local_hostname:
            return self.local_hostname
        try:
            return socket.gethostbyname(host_name())
        except OSError:
            return "127.0.0.1"


def _import_store() -> tuple[Any, Any]:
    # Mooncake logs every connection at INFO through glog, which reads its level from
    # the environment when the library loads; keep warnings and errors unless told.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:  # also OSError-like "libibverbs.so.1: cannot open ..."
        raise StoreUnavailableError(
            f"cannot import mooncake.store ({exc}); {_INSTALL_HINT}"
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


class StoreClient:
    """One process's connection to the store.

    Args:
        settings: Where the store is.
        where: What configured it, for error messages (e.g. ``kv_connector_extra_config``).

    Raises:
        StoreUnavailableError: The client library is not installed.
        StoreError: ``setup`` failed (master unreachable, bad metadata server, ...).
    """

    def __init__(self, settings: StoreSettings, *, where: str = "store") -> None:
        store_type, config_type = _import_store()
        self.settings = settings
        self._store = store_type()
        rc = self._store.setup(
            settings.hostname(),
            settings.metadata_server,
            settings.segment_bytes,
            settings.buffer_bytes,
            settings.protocol,
            settings.device_names,
            settings.master,
        )
        if rc != 0:
            raise StoreError(
                f"{where}: cannot join the Mooncake Store at master {settings.master!r} "
                f"(metadata {settings.metadata_server!r}, setup returned {rc}); is "
                "mooncake_master running and reachable? (`hidden-state store-master`)"
            )
        # Hard-pinned: the master never evicts these, so an unread sample is never lost
        # to memory pressure; a full store fails puts instead (handled in ``put``).
        self._pinned = config_type()
        self._pinned.with_hard_pin = True
        self._pool: ReceivePool | None = None  # registered on first use (get_object)
        self._pool_lock = threading.Lock()

    @property
    def raw_store(self) -> Any:
        """The Mooncake store object beneath the client (``get_into``, ``register_buffer``).

        For measuring the raw transfer under the client's own checks (benchmarks);
        everything else goes through the client's methods.
        """
        return self._store

    def close(self) -> None:
        """Leave the store (objects in other clients' segments stay)."""
        if self._pool is not None:
            # Samples still lent keep the arena's memory alive; only the registration goes.
            self._store.unregister_buffer(self._pool.address)
            self._pool = None
        self._store.close()

    def _fits(self, key: str, size: int) -> None:
        if size > self.settings.buffer_bytes:
            raise StoreError(
                f"{key}: {size} bytes do not fit this client's transfer buffer of "
                f"{self.settings.buffer_bytes} bytes; raise the buffer size (connector: "
                "mooncake_buffer_bytes; reader URL: ?buffer=)"
            )

    def put(self, key: str, value: Any, *, full_timeout: float = 0.0) -> None:
        """Store ``value`` hard-pinned; while the store is full, retry for ``full_timeout`` s.

        A put to a key that exists succeeds and keeps the old value (Mooncake's rule).

        Raises:
            StoreFullError: Still no room after ``full_timeout`` seconds.
            StoreError: Any other failure.
        """
        size = memoryview(value).nbytes
        self._fits(key, size)
        deadline = time.monotonic() + full_timeout
        delay = 0.005
        while True:
            rc = self._store.put(key, value, self._pinned)
            if rc == 0:
                return
            if rc != NO_SPACE:
                raise StoreError(f"{key}: put of {size} bytes failed with code {rc}")
            if time.monotonic() + delay > deadline:
                raise StoreFullError(
                    f"{key}: the store has no room for {size} bytes (waited {full_timeout:g} s "
                    "for readers to consume samples); add segment memory or consume faster"
                )
            time.sleep(delay)  # back-pressure: the caller's writer thread waits here
            delay = min(delay * 2, 0.2)

    def size(self, key: str) -> int | None:
        """Bytes of ``key``'s object, None if there is none (or it is not complete yet)."""
        n = int(self._store.get_size(key))
        return None if n < 0 else n

    def get(self, key: str) -> bytes | None:
        """The object at ``key``, None if there is none.

        One round trip for an object that is there (commit records, claims: the small
        objects of the protocol); only an empty answer costs more, to tell a missing
        object from one too large for the transfer buffer or one whose put just ended.

        Raises:
            StoreError: The object is larger than the transfer buffer, or cannot be read.
        """
        data = self._store.get(key)
        if not data:
            size = self.size(key)
            if size is None:
                return None  # not there (or removed meanwhile)
            self._fits(key, size)
            data = self._store.get(key)  # its put ended between the two calls
            if not data:
                raise StoreError(f"{key}: read nothing of {size} bytes")
        return bytes(data) if not isinstance(data, bytes) else data

    def get_object(self, key: str, size: int | None = None) -> np.ndarray | None:
        """The object at ``key`` as ``uint8`` memory of its own, None if there is none.

        For samples: the transfer lands (``get_into``) straight in memory that becomes
        the sample's: a range of this client's receive arena (``store.pool``, registered
        once, ``buffer_bytes`` large), which goes back to the arena when the last
        tensor viewing it is gone; fresh memory, registered for the one transfer, when
        the arena is full (samples kept by the caller). No copy either way.

        Args:
            key: The object's key.
            size: Its size if known (a commit record's): saves asking the master. An
                object of another size is read as it is (the caller checks the size).

        Raises:
            StoreError: Larger than the transfer buffer, memory cannot be registered, or
                the read failed or came back short.
        """
        if size is None:
            size = self.size(key)
            if size is None:
                return None
        self._fits(key, size)
        if size == 0:
            return np.empty(0, dtype=np.uint8)
        out = self._receive_pool().lend(size)
        if out is not None:
            n = int(self._store.get_into(key, out.ctypes.data, size))
        else:
            out = host_memory.empty_bytes(size)
            self._register(out.ctypes.data, size, "receive buffer for one sample")
            try:
                n = int(self._store.get_into(key, out.ctypes.data, size))
            finally:
                self._store.unregister_buffer(out.ctypes.data)
        if 0 <= n <= size:
            return out if n == size else out[:n]  # shorter than announced: the caller judges
        if n == NOT_FOUND:
            return None  # removed meanwhile
        if n == BUFFER_TOO_SMALL:  # larger than announced (nothing was written): read it all
            actual = self.size(key)
            return None if actual is None else self.get_object(key, max(actual, size + 1))
        raise StoreError(f"{key}: get_into of {size} bytes failed with code {n}")

    @property
    def receive_pool(self) -> ReceivePool | None:
        """The receive arena of ``get_object`` (None before the first sample is read)."""
        return self._pool

    def _receive_pool(self) -> ReceivePool:
        with self._pool_lock:
            if self._pool is None:
                pool = ReceivePool(self.settings.buffer_bytes)
                self._register(pool.address, pool.capacity, "receive arena")
                self._pool = pool
            return self._pool

    def _register(self, address: int, nbytes: int, what: str) -> None:
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise StoreError(
                f"cannot register a {nbytes}-byte {what} with the transfer engine "
                f"(code {rc}); lower the buffer size (reader URL: ?buffer=)"
            )

    def exists(self, keys: list[str]) -> list[bool]:
        """For each key, whether a complete object is there."""
        if not keys:
            return []
        return [r == 1 for r in self._store.batch_is_exist(keys)]

    def remove(self, key: str) -> bool:
        """Delete ``key`` (also if recently read); False if it was not there."""
        return int(self._store.remove(key, True)) == 0

    def put_first(
        self, key: str, value: bytes, *, timeout: float = 30.0, full_timeout: float = 0.0
    ) -> bytes:
        """Put ``value`` unless ``key`` exists; return the value that won.

        Mooncake has no compare-and-set, but a put to an existing key keeps the old
        value, and the master orders the puts of one key: the first put wins and every
        later one reads it back. A winner still mid-put reads as missing; wait for it.
        A winner that died mid-put is discarded by the master after
        ``put_start_discard_timeout_sec`` and the next attempt can win.

        Raises:
            StoreFullError: No room for the value within ``full_timeout`` seconds.
            StoreError: No value became readable within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            self.put(key, value, full_timeout=full_timeout)
            current = self.get(key)
            if current:
                return current
            if time.monotonic() > deadline:
                raise StoreError(f"{key}: no claim became readable within {timeout:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
