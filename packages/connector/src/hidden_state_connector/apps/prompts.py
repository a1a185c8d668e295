"""Prompts for the demo: the bundled English texts, or a JSONL file of ``{"text": ...}``."""

from __future__ import annotations

import json
import os
from importlib import resources
from itertools import cycle, islice

BUNDLED = "prompts.jsonl"
"""The bundled prompt file, in ``hidden_state_connector/data``."""


def parse_jsonl(text: str, source: str) -> list[str]:
    """The ``"text"`` of every non-blank JSON line.

    Args:
        text: File contents.
        source: Name for error messages.

    Returns:
        The texts, in file order.

    Raises:
        ValueError: A line is not a JSON object with a non-empty string ``"text"``.
    """
    texts: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not JSON: {exc.msg}") from None
        value = doc.get("text") if isinstance(doc, dict) else None
        if not isinstance(value, str) or not value:
            raise ValueError(f'{source}:{number}: expected an object with a non-empty "text"')
        texts.append(value)
    if not texts:
        raise ValueError(f"{source}: no prompts")
    return texts


def bundled_prompts() -> list[str]:
    """The few hundred short English texts shipped with the package."""
    data = resources.files("hidden_state_connector").joinpath("data").joinpath(BUNDLED)
    return parse_jsonl(data.read_text(encoding="utf-8"), f"<bundled {BUNDLED}>")


def load_prompts(path: str | os.PathLike[str] | None = None, count: int | None = None) -> list[str]:
    """Prompts for a run.

    Args:
        path: A JSONL file with one ``{"text": ...}`` per line; None for the bundled set.
        count: How many; the list is repeated if the file has fewer. None: all of them.

    Returns:
        The prompts.

    Raises:
        ValueError: The file is malformed or empty, or ``count`` is negative.
        OSError: The file cannot be read.
    """
    if path is None:
        texts = bundled_prompts()
    else:
        with open(path, encoding="utf-8") as handle:
            texts = parse_jsonl(handle.read(), os.fspath(path))
    if count is None:
        return texts
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return list(islice(cycle(texts), count))
