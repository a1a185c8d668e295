"""A model's ``config.json``, found and read in one place.

A model is a local directory or a Hugging Face hub id. A hub model's ``config.json``
comes from the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``, where vLLM looks too)
or, where the caller allows it, is downloaded (that one small file). Read by the
launchers' layer default (``layers``), the architecture check before vLLM starts
(``engine.architecture``) and the demo. Every error names the model or the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from hidden_state_reader.errors import InputError

CONFIG_NAME = "config.json"

HubLookup = Literal["off", "cache", "download"]
"""Where a model that is not a local directory is looked for: nowhere (``"off"``), the
Hugging Face cache, or the cache and then the hub (one download)."""


class ModelConfigError(InputError):
    """A model's ``config.json`` cannot be found or read (the message says which and why)."""


class ModelConfigMissingError(ModelConfigError):
    """There is no ``config.json`` where it was looked for (a local directory, the cache)."""


def _with_hint(message: str, hint: str) -> str:
    return f"{message}; {hint}" if hint else message


def _hub_config_path(model: str, hub: HubLookup, hint: str) -> Path:
    """A hub model's cached ``config.json``, downloaded first if ``hub="download"``."""
    try:
        # Imported here: huggingface_hub comes with vLLM and costs start-up time.
        from huggingface_hub import constants, try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise ModelConfigError(_with_hint(
            f"{model}: not a local directory, and huggingface_hub is not installed to "
            "look it up on the Hugging Face hub", hint
        )) from None  # fmt: skip
    try:
        cached = try_to_load_from_cache(model, CONFIG_NAME)
    except (HFValidationError, ValueError, OSError):
        raise ModelConfigError(_with_hint(
            f"{model}: no such model directory (nor a Hugging Face model id)", hint
        )) from None  # fmt: skip
    if isinstance(cached, str):
        return Path(cached)
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if hub == "cache":
        raise ModelConfigMissingError(_with_hint(f"{model}: {CONFIG_NAME} is not in {where}", hint))
    if constants.HF_HUB_OFFLINE:
        raise ModelConfigMissingError(_with_hint(
            f"{model}: {CONFIG_NAME} is not in {where} and HF_HUB_OFFLINE is set", hint
        ))  # fmt: skip
    return _download(model, hint)


def _download(model: str, hint: str) -> Path:
    """Download a hub model's ``config.json`` into the cache; its path there."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        # One HEAD without retries first: hf_hub_download retries a dead network for
        # ~25 s with a warning per attempt; this fails at once with the real reason.
        get_hf_file_metadata(hf_hub_url(model, CONFIG_NAME), timeout=10)
        return Path(hf_hub_download(model, CONFIG_NAME))
    except Exception as exc:  # network, auth (gated models), unknown id: all the same advice
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError(_with_hint(
            f"{model}: cannot get {CONFIG_NAME} from the Hugging Face hub ({reason})", hint
        )) from None  # fmt: skip


def model_config_path(
    model: str | os.PathLike[str], *, hub: HubLookup = "cache", hint: str = ""
) -> Path:
    """Where a model's ``config.json`` is: in its directory, or in the Hugging Face cache.

    Args:
        model: A local model directory or a Hugging Face hub id.
        hub: Where a model that is not a directory is looked for (``HubLookup``).
        hint: What the user can do instead, appended to every error message.

    Raises:
        ModelConfigMissingError: A directory without ``config.json``; a hub model whose
            config is not cached (``hub="cache"``, or offline).
        ModelConfigError: Neither a directory nor (where looked up) a hub model whose
            config can be had.
    """
    name = os.fspath(model)
    if os.path.isdir(name):
        path = Path(name) / CONFIG_NAME
        if not path.is_file():
            raise ModelConfigMissingError(_with_hint(f"{path}: no such file", hint))
        return path
    if hub == "off":
        raise ModelConfigError(_with_hint(f"{name}: no such model directory", hint))
    return _hub_config_path(name, hub, hint)


def read_model_config(
    model: str | os.PathLike[str], *, hub: HubLookup = "cache", hint: str = ""
) -> dict[str, Any]:
    """A model's ``config.json`` as a dict (see ``model_config_path`` for where from).

    Args:
        model: A local model directory or a Hugging Face hub id.
        hub: Where a model that is not a directory is looked for (``HubLookup``).
        hint: What the user can do instead, appended to every error message.

    Raises:
        ModelConfigMissingError: See ``model_config_path``.
        ModelConfigError: Not found (``model_config_path``), unreadable, not JSON, or
            not a JSON object; the message names the file.
    """
    path = model_config_path(model, hub=hub, hint=hint)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(_with_hint(f"cannot read {path}: {exc}", hint)) from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ModelConfigError(_with_hint(f"{path} is not valid JSON ({exc})", hint)) from None
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        raise ModelConfigError(_with_hint(f"{path} holds a JSON {kind}, not an object", hint))
    return doc
