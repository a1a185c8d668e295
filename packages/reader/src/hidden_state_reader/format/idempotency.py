"""Idempotency keys: a client-chosen key that names a sample, so a retry makes no second one.

A request that carries a key (the connector's ``kv_transfer_params["idempotency_key"]``)
writes ``KEY.safetensors`` in the storage root, whichever engine, restart or attempt
computes it. A retry therefore names the same sample: it finds the first one complete,
or its publication replaces the first atomically (rename), never a second file.
"""

from __future__ import annotations

import re

from hidden_state_reader.format.names import DATA_SUFFIX, Kind, classify

MAX_KEY_CHARS = 200
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def keyed_sample_name(key: object, what: str = "idempotency_key") -> tuple[str, str | None]:
    """The data-file name a key gives its sample.

    Args:
        key: What the client sent.
        what: How the client named it, for the message.

    Returns:
        ``(name, None)``, or ``("", problem)`` naming why the key cannot name a sample.
    """
    if not isinstance(key, str):
        return "", f"{what} must be a string, got {type(key).__name__}"
    if not KEY_PATTERN.fullmatch(key) or len(key) > MAX_KEY_CHARS:
        return "", (
            f"{what} {key!r} must be 1-{MAX_KEY_CHARS} letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    name = key + DATA_SUFFIX
    if classify(name) is not Kind.DATA:
        return "", f"{what} {key!r} would name a temporary file; pick another key"
    return name, None
