"""``kv_connector_extra_config``: parsing, defaults and validation.

vLLM's own keys keep their meaning (``shared_storage_path``, ``use_synchronization_lock``,
``num_writer_threads``, ``allow_custom_save_path``); the rest are ours. Unknown keys are
warned about; a bad value is a start-up error naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hidden_state_connector.engine.store_config import check_store_keys
from hidden_state_connector.logs import get_logger
from hidden_state_reader.format import fp8
from hidden_state_reader.sizes import parse_size
from hidden_state_reader.store.client import StoreSettings

log = get_logger(__name__)

CAPTURE_EXTRACT = "extract"
CAPTURE_FORWARD = "forward"


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see ``docs/connector.md`` for each key).

    Attributes:
        shared_storage_path: Directory the samples are written to; created if missing.
            Checked at start-up (``storage_check.check_storage_root``): vLLM does not
            start unless this process can create, flock, rename and remove a file there.
        use_synchronization_lock: Create and hold ``NAME.safetensors.lock`` while writing.
        num_writer_threads: Threads writing files.
        allow_custom_save_path: Let requests choose ``hidden_states_path`` (inside the
            storage root only).
        host_buffer_bytes: Host memory for samples in flight (pinned on CUDA); the
            bound on the connector's host memory.
        chunk_bytes: Device memory for one gather chunk; the bound on the connector's
            extra device memory, whatever the request length.
        when_full: ``"wait"``: hold the request's KV blocks until buffers free up
            (back-pressure on the scheduler); ``"drop"``: fail the sample instead.
        max_queued_bytes: With ``when_full="drop"``, samples beyond this many bytes
            waiting for a writer are failed.
        fsync: Make each file durable before releasing its lock.
        checksum: Record a CRC32 of the tensor bytes (checked by ``hidden-state verify
            --checksums`` and readers with ``verify_checksum``); computed by the writer
            threads as they write each chunk.
        check_nonfinite: Record whether hidden states contain NaN/inf.
        include_output_tokens: Default for the per-request parameter of that name.
        instance_id: Part of every default file name that keeps engines (data-parallel
            ranks, restarts) from colliding; default: derived from vLLM's engine id.
        shutdown_timeout: Seconds to drain queued writes at shutdown.
        stats_interval: Seconds between progress log lines (0 disables them).
        storage_dtype: ``"model"`` (default): hidden states in the model's dtype;
            ``"fp8_e4m3"``: float8_e4m3fn with per-token, per-layer float32 scales
            (about half the bytes of bf16; readers dequantize, see ``docs/format.md``).
        storage_backend: ``"files"`` (``shared_storage_path``) or ``"mooncake"`` (a
            Mooncake Store; the ``mooncake_*`` keys, ``store_config``).
        mooncake_master: ``host:port`` of ``mooncake_master`` (required for mooncake).
        mooncake_prefix: Key namespace of this data set in the store.
        mooncake_metadata_server: ``P2PHANDSHAKE``, ``http://...`` or ``etcd://...``.
        mooncake_local_hostname: Address other store clients reach this engine at.
        mooncake_protocol: ``tcp`` or ``rdma``.
        mooncake_device_names: RDMA devices.
        mooncake_segment_bytes: Store memory hosted by this engine (default 0: none, so
            a vLLM restart loses nothing; run segment hosts next to the trainers).
        mooncake_buffer_bytes: Transfer buffer: the largest sample this engine can put.
        mooncake_full_timeout: Seconds a sample waits for room in a full store (writer
            threads block: back-pressure) before it fails with a recorded reason.
        mooncake_staging_dir: Where samples are assembled before the put (a tmpfs).
        capture: ``"forward"`` (hooks on the decoder layers copy the residual stream
            during the forward pass; ``engine.forward``) or ``"extract"`` (vLLM's
            ``extract_hidden_states`` speculative method fills a hidden-state KV-cache
            group). None (the default): extract where that speculative method is
            configured, forward otherwise (``engine.engines.choose_capture``).
        layer_ids: For forward capture, the layer ids to capture (0 = embeddings, N =
            last layer before the final norm; default ``[2, N/2, N-3, N]``); refused
            with ``capture="extract"``, which takes them from its speculative config.
        capture_buffer_bytes: With ``capture="forward"``, host memory for the rows of
            requests still running (reserved as address space, committed as rows arrive);
            a request waits until its prompt's rows fit.
        prefix_rows_bytes: With ``capture="forward"`` and prefix caching, the part of
            ``capture_buffer_bytes`` that keeps the rows of full prefix blocks for later
            requests that vLLM serves them from its cache (least recently used go first;
            default a quarter of ``capture_buffer_bytes``).
    """

    shared_storage_path: str = "/tmp"
    use_synchronization_lock: bool = True
    num_writer_threads: int = 8
    allow_custom_save_path: bool = False
    host_buffer_bytes: int = 2 * 1024**3
    chunk_bytes: int = 16 * 1024**2
    when_full: str = "wait"
    max_queued_bytes: int = 8 * 1024**3
    fsync: bool = False
    checksum: bool = True
    check_nonfinite: bool = True
    include_output_tokens: bool = False
    instance_id: str | None = None
    shutdown_timeout: float = 60.0
    stats_interval: float = 30.0
    storage_dtype: str = fp8.STORAGE_MODEL
    storage_backend: str = "files"
    mooncake_master: str | None = None
    # The store client's own defaults: one home, hidden_state_reader.store.client.
    mooncake_prefix: str = StoreSettings.prefix
    mooncake_metadata_server: str = StoreSettings.metadata_server
    mooncake_local_hostname: str = StoreSettings.local_hostname
    mooncake_protocol: str = StoreSettings.protocol
    mooncake_device_names: str = StoreSettings.device_names
    mooncake_segment_bytes: int = StoreSettings.segment_bytes
    mooncake_buffer_bytes: int = StoreSettings.buffer_bytes
    mooncake_full_timeout: float = 60.0
    mooncake_staging_dir: str = "/dev/shm"
    capture: str | None = None
    layer_ids: tuple[int, ...] | None = None
    capture_buffer_bytes: int = 4 * 1024**3
    prefix_rows_bytes: int | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``.

        Raises:
            ValueError: A value has the wrong type or range; the message names the key.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            log.warning(
                "HiddenStateConnector: ignoring unknown kv_connector_extra_config keys %s "
                "(known: %s)",
                unknown,
                ", ".join(sorted(known)),
            )
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            raw = extra[f.name]
            values[f.name] = _coerce(f.name, f.type, raw)
        config = cls(**values)
        config._check()
        if "shared_storage_path" not in extra and config.storage_backend == "files":
            log.warning(
                "HiddenStateConnector: no shared_storage_path given; writing to %s",
                config.shared_storage_path,
            )
        return config

    def _check(self) -> None:
        if not self.shared_storage_path:
            raise ValueError("shared_storage_path: must not be empty")
        if self.num_writer_threads < 1:
            raise ValueError(f"num_writer_threads: must be >= 1, got {self.num_writer_threads}")
        if self.when_full not in ("wait", "drop"):
            raise ValueError(f"when_full: must be 'wait' or 'drop', got {self.when_full!r}")
        if self.chunk_bytes > self.host_buffer_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must not exceed host_buffer_bytes "
                f"({self.host_buffer_bytes})"
            )
        if self.shutdown_timeout < 0 or self.stats_interval < 0:
            raise ValueError("shutdown_timeout and stats_interval must be >= 0")
        fp8.check_storage(self.storage_dtype)
        check_store_keys(self)
        self._check_capture()

    @property
    def prefix_rows_budget(self) -> int:
        """Bytes of held prefix rows (``prefix_rows_bytes``, or its default)."""
        if self.prefix_rows_bytes is not None:
            return self.prefix_rows_bytes
        return self.capture_buffer_bytes // 4

    def _check_capture(self) -> None:
        if self.capture not in (None, CAPTURE_EXTRACT, CAPTURE_FORWARD):
            raise ValueError(
                f"capture: must be {CAPTURE_FORWARD!r} or {CAPTURE_EXTRACT!r}, got {self.capture!r}"
            )
        if self.layer_ids is not None and not self.layer_ids:
            raise ValueError("layer_ids: an empty list; leave it out for the default layers")
        if self.prefix_rows_bytes is not None and (
            self.prefix_rows_bytes >= self.capture_buffer_bytes
        ):
            raise ValueError(
                f"prefix_rows_bytes ({self.prefix_rows_bytes}) must be less than "
                f"capture_buffer_bytes ({self.capture_buffer_bytes}): the rows of running "
                "requests need room in the same host memory"
            )
        if self.capture == CAPTURE_EXTRACT and self.layer_ids is not None:
            raise ValueError(
                "layer_ids: only for forward capture; the extract engine takes its layers "
                "from speculative_config (eagle_aux_hidden_state_layer_ids)"
            )


def _layer_ids(raw: Any) -> tuple[int, ...]:
    """``layer_ids``: a list of non-negative integers."""
    if not isinstance(raw, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw
    ):
        raise ValueError(f"layer_ids: expected a list of layer ids such as [1, 2, 4], got {raw!r}")
    return tuple(int(i) for i in raw)


def _coerce(key: str, annotation: object, raw: Any) -> Any:
    kind = str(annotation)
    if key == "layer_ids":
        return _layer_ids(raw)
    if key.endswith("_bytes"):
        # Hosting no store memory is the point of mooncake_segment_bytes' default.
        return parse_size(key, raw, allow_zero=key == "mooncake_segment_bytes")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ValueError(f"{key}: expected true or false, got {raw!r}")
    if kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"{key}: expected an integer, got {raw!r}")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {raw!r}") from None
    if kind == "float":
        if isinstance(raw, bool):
            raise ValueError(f"{key}: expected a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a number, got {raw!r}") from None
    if not isinstance(raw, str) and not (raw is None and "None" in kind):
        raise ValueError(f"{key}: expected a string, got {raw!r}")
    return raw
