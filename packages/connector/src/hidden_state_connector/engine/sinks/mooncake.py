"""The Mooncake Store medium (``storage_backend="mooncake"``): samples go to the store.

``StoreBackend`` is its ``seam.Sink`` (worker half), ``StoreLookup`` its ``seam.SinkIndex``
(scheduler half); the factory (``engine.engines``) builds them.

The write pipeline stays the file pipeline: each sample is streamed by the format's
``SampleFileWriter`` into a private staging directory (a tmpfs), so the store receives
exactly the bytes a file would hold (header, CRC32, tensors). The seam is the sample's
lock: a ``StoreLock`` is a ``WriterLock`` whose ``release`` (called by the writer once
the staged file is final) ships the file into the store, then commits it
(``StorePublisher``: data key, then commit record), and whose ``fail`` records the
reason under ``failed/NAME`` where readers look. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.write.target import SampleTarget
from hidden_state_connector.logs import get_logger
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.probes import STORE_PUT, probes
from hidden_state_reader.store.client import StoreClient, StoreError, StoreSettings
from hidden_state_reader.store.consumed import written
from hidden_state_reader.store.publish import StorePublisher, publish_file
from hidden_state_reader.store.url import store_url

log = get_logger(__name__)

KEY_PARAM = "hidden_states_key"
"""``kv_transfer_params`` entry naming the sample in the store (``store_name``)."""
URL_PARAM = "hidden_states_url"
"""``kv_transfer_params`` entry: ``mooncake://MASTER/PREFIX/NAME``."""


def store_name(root: str, path: str) -> str:
    """The store name of the sample the file backend would write at ``path``."""
    return os.path.relpath(path, root).replace(os.sep, "/")


def transfer_params(config: ConnectorConfig, root: str, path: str) -> dict[str, str]:
    """What a client learns about its sample in the store: its key and URL."""
    name = store_name(root, path)
    url = f"mooncake://{config.mooncake_master}/{config.mooncake_prefix}/{name}"
    return {KEY_PARAM: name, URL_PARAM: url}


class StoreLock(WriterLock):
    """A sample's lock whose release publishes it to the store (see the module docstring).

    Args:
        name: The sample's store name.
        staged: Path of the staged file the writer publishes.
        publisher: Where it goes.
        request_id: Recorded with a failure.
    """

    def __init__(self, name: str, staged: str, publisher: StorePublisher, request_id: str) -> None:
        super().__init__(staged, -1)
        self._fd = None  # no descriptor: the store is the lock
        self.name = name
        self.staged = staged
        self.publisher = publisher
        self.request_id = request_id
        self._settled = False

    @property
    def held(self) -> bool:
        """Whether the sample is neither published nor failed yet."""
        return not self._settled

    def release(self) -> None:
        """Ship the staged file into the store and commit it (once).

        Raises:
            SampleError, StoreError: Nothing was published; the writer calls ``fail``.
        """
        if self._settled:
            return
        observers = probes(STORE_PUT)
        began = time.monotonic() if observers else 0.0
        publish_file(self.publisher, self.name, self.staged)
        self._settled = True
        for observe in observers:
            observe(staged=self.staged, began=began, ended=time.monotonic())

    def mark_failed(self, reason: str, **detail: Any) -> None:
        """Record the failure in the store (``failed/NAME`` + a commit record)."""
        self.fail(reason, **detail)

    def fail(self, reason: str, **detail: Any) -> None:
        """Record why the sample will never appear, drop the staged file (once)."""
        if self._settled:
            return
        self._settled = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.staged)
        self.publisher.fail(self.name, reason[:1000], request_id=self.request_id, **detail)


def store_settings(config: ConnectorConfig) -> StoreSettings:
    """The store client settings the config names (its keys were checked at start-up)."""
    assert config.mooncake_master
    return StoreSettings(
        master=config.mooncake_master,
        prefix=config.mooncake_prefix,
        metadata_server=config.mooncake_metadata_server,
        local_hostname=config.mooncake_local_hostname,
        protocol=config.mooncake_protocol,
        device_names=config.mooncake_device_names,
        segment_bytes=config.mooncake_segment_bytes,
        buffer_bytes=config.mooncake_buffer_bytes,
    )


_LOOKUP_BUFFER = 1 << 20  # the scheduler's client reads only records of a few hundred bytes


class StoreLookup:
    """The scheduler's question to the store: is a keyed sample written (or consumed)?

    A retry of an idempotency key whose sample is in the store, or was consumed within
    its retention (``hidden_state_reader.store.consumed``), writes nothing and is
    answered ``hidden_states_existed``, as with files. The client (no segment, a small
    buffer) joins on the first keyed request. If the store cannot be asked, the
    request is written: the worker's publish makes the same check before it puts.

    Args:
        config: Validated settings (``storage_backend="mooncake"``).
        root: The connector's path root (names are relative to it).
    """

    def __init__(self, config: ConnectorConfig, root: str) -> None:
        self.root = root
        self._config = config
        self._settings = replace(store_settings(config), segment_bytes=0,
                                 buffer_bytes=_LOOKUP_BUFFER)  # fmt: skip
        self._client: StoreClient | None = None
        self._failed = False

    def written(self, path: str) -> bool:
        """Whether the keyed sample bound for ``path`` needs no writing."""
        name = store_name(self.root, path)
        try:
            if self._client is None and not self._failed:
                self._client = StoreClient(self._settings, where="scheduler's store lookup")
            return self._client is not None and written(self._client, name) is not None
        except StoreError as exc:
            self._failed = self._client is None  # cannot join: do not try on every request
            log.warning("cannot ask the store whether %s is written (%s); the request is "
                        "computed, and its publish checks again", name, exc)  # fmt: skip
            return False

    def unusable(self, path: str) -> str | None:
        """Never: the store writes no directory (the path only names the store key)."""
        return None

    def client_params(self, path: str) -> dict[str, str] | None:
        """Its store key and URL, and no path (nothing is ever written there)."""
        return transfer_params(self._config, self.root, path)

    def close(self) -> None:
        """Leave the store (idempotent)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()


class StoreBackend:
    """One engine's connection to the store: its client, producer slot and staging dir.

    Args:
        config: Validated settings (``storage_backend="mooncake"``).
        root: The connector's path root (names are relative to it).

    Raises:
        StoreError: The store cannot be joined or no producer slot is free.
        StoreUnavailableError: The Mooncake client is not installed.
    """

    always_checksum = True  # store samples always carry a CRC32: readers check every one

    def __init__(self, config: ConnectorConfig, root: str) -> None:
        self.root = root
        settings = store_settings(config)
        self.client = StoreClient(settings, where="kv_connector_extra_config mooncake_master")
        self.publisher = StorePublisher(
            self.client,
            full_timeout=config.mooncake_full_timeout,
            instance=config.instance_id or "",
        )
        base = config.mooncake_staging_dir
        if not os.path.isdir(base):
            base = tempfile.gettempdir()
        self.staging = tempfile.mkdtemp(prefix="hidden-state-staging-", dir=base)
        self._staging_fd = os.open(self.staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        log.info(
            "HiddenStateConnector: writing to the Mooncake Store %s as producer slot %d "
            "(staging in %s)",
            store_url(settings),
            self.publisher.slot,
            self.staging,
        )

    def staged_path(self, path: str) -> str:
        """Where the writer assembles the sample bound for ``path`` (unique per name)."""
        flat = store_name(self.root, path).replace("%", "%25").replace("/", "%2F")
        return os.path.join(self.staging, flat)

    def target(self, req_id: str, path: str) -> SampleTarget:
        """The staging directory and the ``StoreLock`` of a new request's sample."""
        name, staged = store_name(self.root, path), self.staged_path(path)
        lock = StoreLock(name, staged, self.publisher, req_id)
        return SampleTarget(os.dup(self._staging_fd), lock)

    def close(self) -> None:
        """Leave the store and remove the staging directory (idempotent)."""
        with self._lock:
            fd, self._staging_fd = self._staging_fd, -1
        if fd < 0:
            return
        os.close(fd)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.client.close()
