"""Which layers to capture for a model: ``--layers`` parsing and EAGLE-3's default.

Used by the launchers (``hidden-state serve``, ``extract``, ``demo``): a model is a
local directory or a Hugging Face hub id, whose ``num_hidden_layers`` comes from its
``config.json`` (from the Hugging Face cache, or that one file downloaded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hidden_state_reader.errors import InputError


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's choice of layers: low, middle and high (speculators' default)."""
    n = num_hidden_layers
    return sorted({min(2, n - 1), n // 2, max(n - 3, 0)})


def parse_layers(text: str) -> list[int]:
    """``"2,16,29"`` -> ``[2, 16, 29]``; ValueError naming ``--layers`` otherwise."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers takes integers like 2,16,29, got {text!r}") from None
    if not layers or any(x < 0 for x in layers):
        raise ValueError(f"--layers needs non-negative layer ids, got {text!r}")
    return layers


def _layers_in_config(doc: dict[str, Any]) -> int | None:
    """``num_hidden_layers`` of a ``config.json``, or of its ``text_config`` (multimodal)."""
    text_config = doc.get("text_config") or {}
    value = doc.get("num_hidden_layers") or text_config.get("num_hidden_layers")
    return int(value) if value else None


def hub_config_path(model: str) -> str:
    """The local path of a Hugging Face hub model's ``config.json``.

    Looks in the Hugging Face cache first (``HF_HOME`` / ``HF_HUB_CACHE``, as vLLM
    does), then, unless ``HF_HUB_OFFLINE`` is set, downloads just that one small file.

    Args:
        model: A hub id such as ``meta-llama/Llama-3.1-8B-Instruct``.

    Returns:
        The path of the cached ``config.json``.

    Raises:
        InputError: ``model`` is not a valid hub id, or its config is neither cached nor
            downloadable (offline, no network, gated, unknown id).
    """
    hint = "pass --layers (e.g. --layers 2,16,29) or a local model directory"
    try:
        # Imported here: huggingface_hub comes with vLLM and costs start-up time.
        from huggingface_hub import (
            constants,
            get_hf_file_metadata,
            hf_hub_download,
            hf_hub_url,
            try_to_load_from_cache,
        )
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise InputError(
            f"{model}: not a local directory, and huggingface_hub is not installed to "
            f"look it up on the Hugging Face hub; {hint}"
        ) from None
    try:
        cached = try_to_load_from_cache(model, "config.json")
    except HFValidationError:
        raise InputError(
            f"{model}: no such model directory (nor a Hugging Face model id)"
        ) from None
    if isinstance(cached, str):
        return cached
    if constants.HF_HUB_OFFLINE:
        raise InputError(
            f"{model}: config.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and HF_HUB_OFFLINE is set; {hint}"
        )
    try:
        # One HEAD without retries first: hf_hub_download retries a dead network for
        # ~25 s with a warning per attempt; this fails at once with the real reason.
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=10)
        return str(hf_hub_download(model, "config.json"))
    except Exception as exc:  # network, auth (gated models), unknown id: all the same advice
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{model}: cannot get config.json from the Hugging Face hub ({reason}); {hint}"
        ) from None


def num_hidden_layers(model: str) -> int | None:
    """``num_hidden_layers`` of a model directory or Hugging Face hub id (None if unknown).

    A local directory's ``config.json`` is read directly; anything else is taken as a
    hub id and resolved through the Hugging Face cache (see ``hub_config_path``).

    Raises:
        InputError: A hub id whose config cannot be found, or an unreadable config.
    """
    if os.path.isdir(model):
        config = Path(model) / "config.json"
        if not config.is_file():
            return None
    else:
        config = Path(hub_config_path(model))
    try:
        doc: dict[str, Any] = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{model}: cannot read {config}: {exc}; pass --layers") from None
    return _layers_in_config(doc) if isinstance(doc, dict) else None


def resolve_layers(model: str, layers: list[int] | None, include_last: bool) -> list[int]:
    """The layers to capture: explicit, or EAGLE-3's low/middle/high default.

    Args:
        model: A model directory or Hugging Face hub id.
        layers: Explicit layer ids (``--layers``), or None for EAGLE-3's default.
        include_last: Also capture the last layer (``num_hidden_layers``, pre-norm).

    Returns:
        The sorted layer ids.

    Raises:
        InputError: The default cannot be computed (no config found and no --layers), or
            a layer id is out of range.
    """
    # Explicit layers need no config for a hub id (nothing to look up, nothing to download).
    need_config = layers is None or include_last or os.path.isdir(model)
    n = num_hidden_layers(model) if need_config else None
    if layers is None:
        if n is None:
            raise InputError(f"{model}: no num_hidden_layers in config.json; pass --layers")
        layers = default_layer_ids(n)
    if include_last:
        if n is None:
            raise InputError(f"{model}: --include-last needs num_hidden_layers in config.json")
        layers = sorted(set(layers) | {n})
    if n is not None and any(x > n for x in layers):
        raise InputError(f"--layers: layer ids must be <= {n} (num_hidden_layers), got {layers}")
    return layers
