"""Tensor layouts of headers already validated, so the same layout is not validated again.

A process cache (the format's rule is ``format.header.parse_header``; this module is the
memo the readers hand it). Files of one writer and one sample length have headers that
differ only in their ``__metadata__`` (CRC-32, request id, creation time): the tensor
entries that follow it, and everything ``parse_header`` proves from them alone, are byte
for byte the same. ``format.header.split_metadata`` splits a header written in this form
(``__metadata__`` first, as our writers and safetensors write it) into the metadata
object and the *tail* after it; a tail seen before, in a header that passed the full
rule, gives back its validated tensors, and only what depends on the file is checked
again (the metadata, the file's size, the capture metadata). For small files the full
JSON parse and validation are a large part of the time it takes to read one
(``benchmarks/reader.py``).

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

from hidden_state_reader.format.tensors import TensorInfo

MAX_LAYOUTS = 1024
"""Tails remembered at most (one per shape of sample in practice; about 1 KB each)."""

# tail -> (tensors, end of the last tensor's data relative to the data section)
_layouts: dict[str, tuple[Mapping[str, TensorInfo], int]] = {}


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
