"""Which layers to capture for a model: ``--layers`` parsing and EAGLE-3's default.

Used by the launchers (``hidden-state serve``, ``extract``, ``demo``): a model is a
local directory or a Hugging Face hub id, whose ``num_hidden_layers`` comes from its
``config.json`` (from the Hugging Face cache, or that one file downloaded).
"""

from __future__ import annotations

import os
from typing import Any

from hidden_state_connector.model_config import ModelConfigMissingError, read_model_config
from hidden_state_reader.errors import InputError

_HINT = "pass --layers (e.g. --layers 2,16,29) or a local model directory"


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


def num_hidden_layers(model: str) -> int | None:
    """``num_hidden_layers`` of a model directory or Hugging Face hub id (None if unknown).

    A local directory's ``config.json`` is read directly (None if it has none); anything
    else is taken as a hub id: its config comes from the Hugging Face cache, or that one
    file is downloaded unless ``HF_HUB_OFFLINE`` is set (``model_config``).

    Raises:
        InputError: A hub id whose config cannot be had, or an unreadable config.
    """
    local = os.path.isdir(model)
    try:
        doc = read_model_config(model, hub="download", hint="pass --layers" if local else _HINT)
    except ModelConfigMissingError:
        if local:
            return None
        raise
    return _layers_in_config(doc)


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
