"""What an extraction run is asked to do, and the vLLM and connector settings it implies.

``ExtractOptions`` is the request. From it come the ``vllm.LLM`` keyword arguments
(``engine_settings``, with the connector's ``kv_connector_extra_config`` from
``connector_settings``) and the settings that shape the files (``run_settings``), which
a resumed run must share with the runs before it (``check_compatible``). Each check
raises ``UsageError`` naming the option at fault.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hidden_state_connector.apps.offline.errors import UsageError
from hidden_state_connector.apps.server import (
    capture_settings,
    cpu_kv_cache_bytes,
    kv_transfer_config,
)
from hidden_state_connector.engine.config import ConnectorConfig

RESERVED_ENGINE_ARGS = {
    "model": "the MODEL argument",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "speculative_config": "--layers (with --capture extract)",
    "kv_transfer_config": "--connector-config",
}


@dataclass
class ExtractOptions:
    """Everything one extraction run needs.

    Attributes:
        model: Model directory or Hugging Face name.
        input: JSONL / JSON file or ``save_to_disk`` folder.
        out_dir: Output directory (the connector's storage root).
        layers: Layer ids to capture (as configured; captured in ascending order).
        max_tokens: Tokens to generate per request (1 = prefill only).
        include_output_tokens: Also store the generated tokens (but the last).
        batch_size: Requests kept in flight in vLLM.
        max_model_len: vLLM's ``max_model_len`` (None: the model's).
        dtype: vLLM's ``dtype``.
        limit: Only the first ``limit`` records.
        split: Split of a ``DatasetDict`` input.
        retry_failed: Retry samples the manifest records as failed.
        engine_args: Further ``vllm.LLM`` keyword arguments.
        connector_config: Further ``kv_connector_extra_config`` keys.
        lock_timeout: Seconds to wait for one file's writer.
        progress_interval: Minimum seconds between progress lines.
        verify_threads: Threads waiting on locks and verifying files.
        capture: The capture engine, ``"forward"`` (default) or ``"extract"``.
    """

    model: str
    input: str
    out_dir: str
    layers: list[int]
    max_tokens: int = 1
    include_output_tokens: bool = False
    batch_size: int = 256
    max_model_len: int | None = None
    dtype: str = "auto"
    limit: int | None = None
    split: str | None = None
    retry_failed: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)
    connector_config: dict[str, Any] = field(default_factory=dict)
    lock_timeout: float = 600.0
    progress_interval: float = 1.0
    verify_threads: int = 4
    capture: str = "forward"

    @property
    def captured_layers(self) -> list[int]:
        """The layer axis of the files: ascending, without repeats."""
        return sorted(set(self.layers))


def connector_settings(user: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of an extraction run (validated).

    Raises:
        UsageError: An unknown key, a bad value, or a key that extract must control.
    """
    known = {f.name for f in dataclasses.fields(ConnectorConfig)}
    for key in user:
        if key not in known:
            raise UsageError(
                f"--connector-config: unknown key {key!r} (known: {', '.join(sorted(known))})"
            )
    given_root = user.get("shared_storage_path")
    if given_root is not None and os.path.realpath(str(given_root)) != os.path.realpath(out_dir):
        raise UsageError("--connector-config: shared_storage_path is set by --out; leave it out")
    merged = {"allow_custom_save_path": True, "stats_interval": 0, **user}
    merged["shared_storage_path"] = out_dir
    try:
        config = ConnectorConfig.from_extra_config(merged)
    except ValueError as exc:
        raise UsageError(f"--connector-config: {exc}") from None
    for key in ("allow_custom_save_path", "use_synchronization_lock"):
        if not getattr(config, key):
            raise UsageError(f"--connector-config: {key} must stay true for extract")
    return merged


def engine_settings(options: ExtractOptions, out_dir: str, *, on_cpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments (without ``model``).

    Raises:
        UsageError: ``engine_args`` sets something extract controls.
    """
    check_reserved(options.engine_args, options.capture)
    kwargs: dict[str, Any] = dict(options.engine_args)
    kwargs["dtype"] = options.dtype
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    spec, keys = capture_settings(options.capture, options.layers)
    if spec is not None:
        kwargs["speculative_config"] = spec
    kwargs["kv_transfer_config"] = kv_transfer_config(
        out_dir, connector_settings({**keys, **options.connector_config}, out_dir)
    )
    if on_cpu:
        size = cpu_kv_cache_bytes(kwargs)
        if size is not None:
            kwargs["kv_cache_memory_bytes"] = size
        kwargs.setdefault("enforce_eager", True)
    # Not skip_tokenizer_init: without its tokenizer vLLM neither stops at EOS nor checks
    # token ids against the vocabulary (an out-of-range id then kills the engine core).
    return kwargs


def check_reserved(engine_args: Iterable[str], capture: str = "forward") -> None:
    """Refuse engine arguments that extract sets itself.

    Forward capture leaves ``speculative_config`` to the user (a drafter beside it).

    Raises:
        UsageError: Naming the key and the option that sets it.
    """
    for key in engine_args:
        if key == "speculative_config" and capture == "forward":
            continue
        if key in RESERVED_ENGINE_ARGS:
            raise UsageError(
                f"--engine-args: {key!r} is set by {RESERVED_ENGINE_ARGS[key]}; leave it out"
            )


def import_vllm() -> Any:
    """The ``vllm`` module.

    Raises:
        RuntimeError: It is not installed (or fails to import); the message says what to do.
    """
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError(
            f"cannot import vLLM ({exc}); install hidden-state-connector[cuda] or [cpu]"
        ) from exc
    return vllm


def check_engine_args(engine_args: Iterable[str]) -> None:
    """Refuse keys that neither ``vllm.LLM`` nor ``vllm.EngineArgs`` accept.

    Raises:
        UsageError: Naming the first unknown key.
    """
    vllm = import_vllm()
    LLM, EngineArgs = vllm.LLM, vllm.EngineArgs  # noqa: N806 - class names
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    known |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    for key in engine_args:
        if key not in known:
            raise UsageError(f"--engine-args: unknown vLLM engine argument {key!r}")


def _model_identity(model: str) -> str:
    return os.path.realpath(model) if os.path.isdir(model) else model


def run_settings(options: ExtractOptions) -> dict[str, Any]:
    """The settings that shape the files; a resumed run must use the same ones."""
    return {
        "model": _model_identity(options.model),
        "layers": options.captured_layers,
        "include_output_tokens": options.include_output_tokens,
    }


def check_compatible(previous: dict[str, Any] | None, current: dict[str, Any], out: str) -> None:
    """Refuse to mix files of different models, layers or token kinds in one directory.

    Raises:
        UsageError: Naming the setting that differs.
    """
    if previous is None:
        return
    for key, value in current.items():
        if key in previous and previous[key] != value:
            raise UsageError(
                f"--out {out}: holds samples written with {key}={previous[key]!r}, this run "
                f"has {key}={value!r}; use another --out directory"
            )
