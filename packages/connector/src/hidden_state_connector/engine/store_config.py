"""Validation of the ``mooncake_*`` keys of ``kv_connector_extra_config``.

Checked when the connector is built (scheduler and workers), so a mistake stops vLLM at
start-up with a message naming the key; joining the store itself happens when the
worker registers its caches (``sinks.mooncake``), and fails start-up naming the
master. This module knows the keys, not ``ConnectorConfig`` (which calls it): it takes
any object that has them.
"""

from __future__ import annotations

import re
from typing import Protocol

from hidden_state_connector.logs import get_logger
from hidden_state_reader.format.store_keys import check_prefix

log = get_logger(__name__)

BACKENDS = ("files", "mooncake")
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


class StoreKeys(Protocol):
    """The keys checked here (``ConnectorConfig`` has them)."""

    @property
    def storage_backend(self) -> str: ...  # noqa: D102
    @property
    def mooncake_master(self) -> str | None: ...  # noqa: D102
    @property
    def mooncake_prefix(self) -> str: ...  # noqa: D102
    @property
    def mooncake_protocol(self) -> str: ...  # noqa: D102
    @property
    def mooncake_full_timeout(self) -> float: ...  # noqa: D102
    @property
    def mooncake_staging_dir(self) -> str: ...  # noqa: D102


def check_store_keys(config: StoreKeys) -> None:
    """Raise ``ValueError`` naming the first bad ``storage_backend``/``mooncake_*`` key."""
    if config.storage_backend not in BACKENDS:
        raise ValueError(
            f"storage_backend: must be one of {BACKENDS}, got {config.storage_backend!r}"
        )
    if config.storage_backend != "mooncake":
        if config.mooncake_master is not None:
            log.warning("mooncake_master is set but storage_backend is 'files'; it is ignored")
        return
    if not config.mooncake_master:
        raise ValueError(
            "mooncake_master: required with storage_backend='mooncake' (host:port of "
            "mooncake_master, e.g. '10.0.0.5:50051'; `hidden-state store-master` starts one)"
        )
    if not _HOST_PORT.match(config.mooncake_master):
        raise ValueError(f"mooncake_master: expected host:port, got {config.mooncake_master!r}")
    try:
        check_prefix(config.mooncake_prefix)
    except ValueError as exc:
        raise ValueError(f"mooncake_prefix: {exc}") from None
    if config.mooncake_protocol not in ("tcp", "rdma"):
        raise ValueError(
            f"mooncake_protocol: must be 'tcp' or 'rdma', got {config.mooncake_protocol!r}"
        )
    if config.mooncake_full_timeout < 0:
        raise ValueError(f"mooncake_full_timeout: must be >= 0, got {config.mooncake_full_timeout}")
    if not config.mooncake_staging_dir:
        raise ValueError("mooncake_staging_dir: must not be empty")
