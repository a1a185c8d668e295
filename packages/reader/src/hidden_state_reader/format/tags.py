"""Client tags: a small flat map of strings recorded in a sample's ``__metadata__``.

A client attaches tags to a request (the connector's ``kv_transfer_params["metadata"]``)
to say where the sample came from: the policy version of an RL rollout, the row id of a
dataset record. Each tag is one ``__metadata__`` entry under its own key, so a reader
finds it as ``sample.metadata[key]``; ``Meta.TAG_KEYS`` lists which entries are tags.
The rules here bound what a client can put into every file's header.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from hidden_state_reader.format.header import Meta

MAX_TAGS = 32
MAX_TAG_KEY_CHARS = 64
MAX_TAG_VALUE_CHARS = 1024
MAX_TAGS_BYTES = 8192  # keys and values together, UTF-8
TAG_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
RESERVED_KEYS = frozenset(
    value for name, value in vars(Meta).items() if name.isupper() and isinstance(value, str)
)
"""The format's own ``__metadata__`` keys: no tag may take one."""


def check_tags(tags: object, what: str = "metadata") -> tuple[dict[str, str], str | None]:
    """Validate a client's tags.

    Args:
        tags: What the client sent (a JSON object of strings is expected).
        what: How the client named it, for the message.

    Returns:
        ``(tags, None)`` when valid (a copy); ``({}, problem)`` naming the first problem.
    """
    if not isinstance(tags, Mapping):
        return {}, f"{what} must be an object of string keys to string values, got {_kind(tags)}"
    if len(tags) > MAX_TAGS:
        return {}, f"{what} has {len(tags)} entries; at most {MAX_TAGS} are stored"
    total = 0
    for key, value in tags.items():
        problem = _check_tag(key, value, what)
        if problem is not None:
            return {}, problem
        total += len(key.encode()) + len(value.encode())
    if total > MAX_TAGS_BYTES:
        return {}, f"{what} holds {total} bytes of keys and values; at most {MAX_TAGS_BYTES}"
    return dict(tags), None


def _check_tag(key: object, value: object, what: str) -> str | None:
    if not isinstance(key, str) or not TAG_KEY.fullmatch(key) or len(key) > MAX_TAG_KEY_CHARS:
        return (
            f"{what} key {key!r} must be a letter followed by letters, digits, '_', '.' or "
            f"'-', at most {MAX_TAG_KEY_CHARS} characters"
        )
    if key in RESERVED_KEYS:
        return f"{what} key {key!r} is one of the format's own keys; pick another name"
    if not isinstance(value, str):
        return f"{what}[{key!r}] must be a string, got {_kind(value)}"
    if len(value) > MAX_TAG_VALUE_CHARS:
        return f"{what}[{key!r}] has {len(value)} characters; at most {MAX_TAG_VALUE_CHARS}"
    return None


def _kind(value: object) -> str:
    return type(value).__name__


def tag_metadata(tags: Mapping[str, str] | None) -> dict[str, str]:
    """The ``__metadata__`` entries that record checked tags ({} for none).

    Entries under one of the format's own keys (``RESERVED_KEYS``: the connector adds
    ``Meta.IDEMPOTENCY_KEY`` itself, a client cannot) are recorded but not listed as tags.
    """
    if not tags:
        return {}
    listed = sorted(k for k in tags if k not in RESERVED_KEYS)
    return {**tags, Meta.TAG_KEYS: json.dumps(listed)} if listed else dict(tags)


def sample_tags(metadata: Mapping[str, str]) -> dict[str, str]:
    """The client tags among a sample's ``__metadata__`` ({} when it has none)."""
    try:
        keys = json.loads(metadata.get(Meta.TAG_KEYS, "[]"))
    except ValueError:
        return {}
    if not isinstance(keys, list):
        return {}
    return {k: metadata[k] for k in keys if isinstance(k, str) and k in metadata}
