"""Tensor layouts of headers already validated, so the same layout is not validated again.

Files of one writer and one sample length have headers that differ only in their
``__metadata__`` (CRC-32, request id, creation time): the tensor entries that follow it,
and everything ``parse_header`` proves from them alone, are byte for byte the same. A
header written in this form (``__metadata__`` first, as our writers and safetensors write
it) is split into the metadata object and the *tail* after it; a tail seen before, in a
header that passed the full rule, gives back its validated tensors, and only what
depends on the file is checked again (the metadata, the file's size, the capture
metadata). For small files the full JSON parse and validation are a large part of the
time it takes to read one (``benchmarks/reader.py``).

Why a hit means what the full rule would conclude: JSON parses the members after an
object's first one the same way whatever that first value was, so a tail that parsed
after one metadata object parses to the same members after any other. A tail is
remembered only when it holds no second ``__metadata__`` member (which would override
the first one), and only after the whole header it came from passed ``parse_header``.

Needs no torch; a cache per process, bounded (``MAX_LAYOUTS``), safe across threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from hidden_state_reader.format.tensors import TensorInfo

MAX_LAYOUTS = 1024
"""Tails remembered at most (one per shape of sample in practice; about 1 KB each)."""

_PREFIX = '{"__metadata__":'
_JSON_SPACE = " \t\n\r"
# The C scanner behind json.loads, positioned at one value: parses just the metadata.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]

# tail -> (tensors, end of the last tensor's data relative to the data section)
_layouts: dict[str, tuple[Mapping[str, TensorInfo], int]] = {}


def split(header_bytes: bytes) -> tuple[Any, str] | None:
    """The value of a leading ``__metadata__`` member and the text after it (the tail).

    None when the header does not start exactly with ``{"__metadata__":`` followed by a
    JSON value, or is not strict UTF-8: the full parse then decides.
    """
    try:
        text = header_bytes.decode()
        if not text.startswith(_PREFIX):
            return None
        metadata, end = _scan(text, len(_PREFIX))
    except (ValueError, StopIteration, RecursionError):
        return None
    # Without the padding after the closing brace (JSON whitespace, which every parse
    # skips): headers padded to different lengths share their layout.
    return metadata, text[end:].rstrip(_JSON_SPACE)


lookup: Callable[[str], tuple[Mapping[str, TensorInfo], int] | None] = _layouts.get
"""``lookup(tail)``: the validated tensors of a tail seen before, and where their data
ends (None for a new tail). The dictionary's own ``get``: no Python call per file."""


def remember(tail: str, tensors: Mapping[str, TensorInfo], data_end: int) -> None:
    """Record the tensors of a header that passed the full rule, if its tail is reusable."""
    if tail in _layouts or not tail.startswith(","):
        return
    try:
        members = json.loads("{" + tail[1:])
    except ValueError:
        return
    if not isinstance(members, dict) or "__metadata__" in members:
        return  # a second metadata member would override the first one
    if len(_layouts) >= MAX_LAYOUTS:
        _layouts.clear()  # simpler than LRU, and safe against concurrent use
    _layouts[tail] = (dict(tensors), data_end)


def clear() -> None:
    """Forget every layout (each header then takes the full rule once more)."""
    _layouts.clear()
