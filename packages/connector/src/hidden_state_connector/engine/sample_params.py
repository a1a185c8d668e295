"""A client's per-request tags and idempotency key (``kv_transfer_params``), checked.

The rules (sizes, allowed characters, the file name a key gives) are the format's
(``hidden_state_reader.format.tags`` and ``.idempotency``); this module reads them from
a request's parameters and says, in one line, why a value is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hidden_state_reader.format import check_tags, keyed_sample_name

TAGS_PARAM = "metadata"
"""``kv_transfer_params`` entry: string tags stored in the sample's ``__metadata__``."""
KEY_PARAM = "idempotency_key"
"""``kv_transfer_params`` entry: names the sample, so a retried request makes no second one."""
EXISTED_PARAM = "hidden_states_existed"
"""Response entry: True when the keyed sample was already complete (nothing was written)."""


def requested_tags(params: Mapping[str, Any]) -> tuple[dict[str, str] | None, str | None]:
    """The request's tags: ``(tags or None, None)``, or ``(None, problem)`` when refused."""
    if params.get(TAGS_PARAM) is None:
        return None, None
    tags, problem = check_tags(params[TAGS_PARAM], TAGS_PARAM)
    if problem is not None:
        return None, problem
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
    """Whether a complete sample is published at ``path`` (only complete files get the name)."""
    return os.path.isfile(path)
