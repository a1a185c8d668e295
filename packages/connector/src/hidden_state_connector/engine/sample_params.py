"""A client's per-request tags and idempotency key (``kv_transfer_params``), checked.

The rules (sizes, allowed characters, the file name a key gives) are the format's
(``hidden_state_reader.format.tags`` and ``.idempotency``); this module reads them from
a request's parameters and says, in one line, why a value is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hidden_state_reader.format import Meta, check_tags, keyed_sample_name
from hidden_state_reader.read.consumed_keys import is_consumed

TAGS_PARAM = "metadata"
"""``kv_transfer_params`` entry: string tags stored in the sample's ``__metadata__``."""
KEY_PARAM = "idempotency_key"
"""``kv_transfer_params`` entry: names the sample, so a retried request makes no second one."""
EXISTED_PARAM = "hidden_states_existed"
"""Response entry: True when the keyed sample was complete already, or consumed within
its retention (nothing was written)."""


def requested_tags(params: Mapping[str, Any]) -> tuple[dict[str, str] | None, str | None]:
    """The request's tags: ``(tags or None, None)``, or ``(None, problem)`` when refused.

    A request with an idempotency key (checked before) also gets the key, under
    ``Meta.IDEMPOTENCY_KEY``: the consumer that removes the sample records it as consumed.
    """
    tags: dict[str, str] = {}
    if params.get(TAGS_PARAM) is not None:
        tags, problem = check_tags(params[TAGS_PARAM], TAGS_PARAM)
        if problem is not None:
            return None, problem
    if isinstance(params.get(KEY_PARAM), str):
        tags[Meta.IDEMPOTENCY_KEY] = params[KEY_PARAM]
    return tags or None, None


def keyed_path(
    root: str, params: Mapping[str, Any], path_param: str
) -> tuple[str | None, str | None]:
    """The path an idempotency key names: ``(path or None, None)``, or ``(None, problem)``.

    Args:
        root: The storage root (absolute).
        params: The request's ``kv_transfer_params``.
        path_param: The custom-path entry, which a key excludes.
    """
    if params.get(KEY_PARAM) is None:
        return None, None
    if params.get(path_param) is not None:
        return None, f"send either {KEY_PARAM} or {path_param}, not both"
    name, problem = keyed_sample_name(params[KEY_PARAM], KEY_PARAM)
    if problem is not None:
        return None, problem
    return os.path.join(root, name), None


def sample_exists(path: str) -> bool:
    """Whether the keyed sample at ``path`` is written: published, or consumed since.

    Only complete files get the name; a consumer that deleted or moved the sample left
    a record of its key (``hidden_state_reader.read.consumed_keys``) that counts until
    it expires.
    """
    return os.path.isfile(path) or is_consumed(os.path.dirname(path), os.path.basename(path))
