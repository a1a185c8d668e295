"""Listing a storage directory: its samples (by data or lock file) and temporary files.

The one directory scan of the package: the readers' sources, ``sample.health`` and the
``hidden-state`` commands all see a directory through ``list_entries`` (or
``list_samples``); ``describe_empty`` says what a directory without samples holds.
Nothing here watches, waits or opens a file.
"""

from __future__ import annotations

import os

from hidden_state_reader.format.names import (
    DATA_SUFFIX,
    Kind,
    classify,
    group_names,
    natural_key,
    sample_key,
)


def list_samples(root: str) -> list[str]:
    """Names of all samples in ``root`` (data files and pending locks), natural order.

    Args:
        root: The storage directory (not searched recursively).

    Returns:
        Sample names such as ``hs_0.safetensors``, sorted so ``hs_2`` precedes ``hs_10``.
    """
    return sorted(scan_samples(root), key=natural_key)


def scan_samples(root: str) -> set[str]:
    """The sample names of ``root``, unordered (one ``listdir``; see ``list_entries``)."""
    return _entries(root)[0]


def _entries(root: str) -> tuple[set[str], list[str]]:
    """One pass over a directory: sample names (by data or lock file), temp-file names."""
    return group_names(os.listdir(root))  # names only: no per-entry object or stat


def list_entries(root: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """List a storage directory once: sample names and temporary-file names.

    The one directory scan of the package: readers (``list_samples``, ``scan_samples``),
    ``scan_health`` and the ``hidden-state`` commands all see a directory through it.

    Args:
        root: The storage directory (not searched recursively; hidden entries such as
            ``.claims`` and ``.quarantine`` are ignored).

    Returns:
        ``(samples, temps)``, both in natural order. A sample appears once whether it
        was seen through its data file, its lock, or both.

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.
    """
    samples, temps = _entries(os.fspath(root))
    return sorted(samples, key=natural_key), sorted(temps, key=natural_key)


def describe_empty(root: str) -> str:
    """Say what a directory without samples holds (for the "no samples" warning).

    Args:
        root: The storage directory.

    Returns:
        One sentence naming the directory, what is in it, and which sub-folders hold
        samples (readers do not descend into them: point a reader at each).
    """
    subdirs = sample_subfolders(root)
    others = temps = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(".") and classify(entry.name) is not Kind.TEMP:
                continue  # the readers' own bookkeeping
            if entry.is_dir(follow_symlinks=False):
                continue
            if classify(entry.name) is Kind.TEMP:
                temps += 1
            else:
                others += 1
    what = [f"{others} other file(s)"] if others else []
    if temps:
        what.append(f"{temps} temporary file(s) (writers at work, or died)")
    text = f"no samples (*{DATA_SUFFIX}) found in {root}: " + (", ".join(what) or "it is empty")
    if subdirs:
        shown = ", ".join(subdirs[:5])
        text += (
            f"; samples are in sub-folders ({shown}{', ...' if len(subdirs) > 5 else ''}), "
            "which readers do not search: point the reader at each sub-folder"
        )
    return text


def sample_subfolders(root: str) -> list[str]:
    """The sub-folders of ``root`` (not hidden ones) that hold samples, natural order.

    Readers do not descend into them; a directory whose samples are all there is most
    likely one level too high.
    """
    with os.scandir(root) as entries:
        found = [
            e.name
            for e in entries
            if not e.name.startswith(".")
            and e.is_dir(follow_symlinks=False)
            and _holds_samples(e.path)
        ]
    return sorted(found, key=natural_key)


def _holds_samples(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(sample_key(e.name) is not None for e in entries)
    except OSError:
        return False
