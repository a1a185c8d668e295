"""File naming of format v1: which names are samples, locks, temporaries.

A sample ``NAME.safetensors`` has a companion ``NAME.safetensors.lock``. Writers that
publish atomically write ``NAME.safetensors.tmp.<unique>`` first; readers ignore those.
Readers keep their own bookkeeping in hidden sub-folders of the storage root
(``.claims/``, ``.quarantine/``), which scans never descend into.
"""

from __future__ import annotations

import enum
import os
import re
import uuid
from collections.abc import Iterable
from typing import Any

DATA_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
TEMP_INFIX = ".tmp."
CLAIMS_DIR = ".claims"
QUARANTINE_DIR = ".quarantine"

# Linux NAME_MAX; a component longer than this cannot be created at all.
MAX_COMPONENT_BYTES = 255
# Custom sample paths: a client may not make the connector build a deep tree (each level
# is a directory it creates) or a path the kernel will refuse (PATH_MAX).
MAX_SUBDIR_DEPTH = 16
MAX_PATH_BYTES = 4095
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
FOREIGN_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


class Kind(enum.Enum):
    """What a directory entry is, judged by its name alone."""

    DATA = "data"
    LOCK = "lock"
    TEMP = "temp"
    OTHER = "other"


def classify(filename: str) -> Kind:
    """Classify a bare file name (no directory part)."""
    if filename.startswith("."):
        # safetensors >= 0.8 (vLLM's own connector) writes ".tmpXXXXXX" and renames it.
        return Kind.TEMP if FOREIGN_TEMP.match(filename) else Kind.OTHER
    if TEMP_INFIX in filename:
        return Kind.TEMP
    if filename.endswith(DATA_SUFFIX + LOCK_SUFFIX):
        return Kind.LOCK
    if filename.endswith(DATA_SUFFIX):
        return Kind.DATA
    return Kind.OTHER


def sample_key(filename: str) -> str | None:
    """Return the data-file name a data or lock file belongs to, or None for other names."""
    kind = classify(filename)
    if kind is Kind.DATA:
        return filename
    if kind is Kind.LOCK:
        return filename[: -len(LOCK_SUFFIX)]
    return None


def group_names(names: Iterable[str]) -> tuple[set[str], list[str]]:
    """A directory's sample names (by data or lock file) and temporary-file names.

    The samples as ``sample_key`` names them, the temporaries as ``classify`` finds them.
    Decides the two names of nearly every entry (not hidden, no temporary infix, a data
    or lock suffix) inline, without a call per name: a directory of a big run lists
    hundreds of thousands; the rest goes through ``classify``.
    """
    samples: set[str] = set()
    temps: list[str] = []
    data, lock = DATA_SUFFIX, DATA_SUFFIX + LOCK_SUFFIX
    for name in names:
        if name[:1] != "." and TEMP_INFIX not in name:
            if name.endswith(data):
                samples.add(name)
                continue
            if name.endswith(lock):
                samples.add(name[: -len(LOCK_SUFFIX)])
                continue
        kind = classify(name)
        if kind is Kind.TEMP:
            temps.append(name)
        elif kind is not Kind.OTHER:
            samples.add(name if kind is Kind.DATA else name[: -len(LOCK_SUFFIX)])
    return samples, temps


def lock_path(data_path: str) -> str:
    """Companion lock path of a data file."""
    return data_path + LOCK_SUFFIX


def temp_path(final_path: str) -> str:
    """A unique temporary name next to ``final_path`` that readers ignore."""
    return f"{final_path}{TEMP_INFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}"


_TEMP_TAIL = re.compile(re.escape(TEMP_INFIX) + r"\d+\.[0-9a-f]{12}$")


def is_temp_name(filename: str) -> bool:
    """Whether ``filename`` is a name ``temp_path`` made (whatever the final name).

    Stricter than ``classify``, for folders whose final names are not samples (a group's
    member files, named after hosts that may hold ``.tmp.`` themselves).
    """
    return _TEMP_TAIL.search(filename) is not None


def safe_component(text: str, max_bytes: int = 120) -> str:
    """Turn arbitrary text (a request id) into a safe, bounded file-name component.

    Characters outside ``[A-Za-z0-9._-]`` become ``_``; leading dots are dropped so the
    result is never hidden or ``..``; over-long text is cut and suffixed with a hash so
    distinct ids stay distinct.
    """
    cleaned = _UNSAFE.sub("_", text).lstrip(".") or "_"
    if cleaned == text and len(cleaned) <= max_bytes:
        return cleaned
    digest = uuid.uuid5(uuid.NAMESPACE_OID, text).hex[:10]
    return f"{cleaned[: max_bytes - 11]}-{digest}"


_DIGIT_RUNS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key that orders ``hs_2`` before ``hs_10``.

    The name split at its runs of digits: text, number, text, ... (``re.split`` with a
    group always alternates, starting with text), so two keys compare text with text
    and number with number, position by position.
    """
    parts: list[Any] = _DIGIT_RUNS.split(name)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)
