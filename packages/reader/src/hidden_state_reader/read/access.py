"""Checks made before the first sample: can the reader do what its options ask?

``claim=True`` writes claim files under ``<root>/.claims/``; ``on_consumed="delete"``
removes files from the root; ``"move"`` renames them into the done folder; an owning
reader moves rejected files to ``<root>/.quarantine/``. Each needs write and search
permission on a directory: ``check_writable`` says so at construction, with a typed
error naming the directory, the option and the missing permission.
"""

from __future__ import annotations

import os

from hidden_state_reader.errors import DirectoryNotWritableError
from hidden_state_reader.files.fileio import nearest_existing
from hidden_state_reader.format.names import CLAIMS_DIR

_EFFECTIVE = os.access in os.supports_effective_ids


def _missing(directory: str) -> str | None:
    """The permission this process lacks to create and remove entries, if any."""
    if not os.path.isdir(directory):
        return "a directory (it is not one)"
    lacks = [
        word
        for flag, word in ((os.W_OK, "write"), (os.X_OK, "search (x)"))
        if not os.access(directory, flag, effective_ids=_EFFECTIVE)
    ]
    if not lacks:
        return None
    return " and ".join(lacks) + " permission"


def check_writable(directory: str, mode: str, why: str) -> None:
    """Raise unless entries can be created and removed in ``directory``.

    A directory that does not exist yet is checked through its nearest existing parent
    (it will be created there).

    Args:
        directory: The directory the mode writes.
        mode: The option that needs it, as the user wrote it (``claim=True``).
        why: What the mode does there, in a few words.

    Raises:
        DirectoryNotWritableError: The permission is missing (or the filesystem is
            read-only).
    """
    target = nearest_existing(directory)
    missing = _missing(target)
    if missing is not None:
        raise DirectoryNotWritableError(
            target, mode, missing, f"{why}; running as uid {os.geteuid()}"
        )


def check_modes(root: str, *, claim: bool, group: str, on_consumed: str, done_dir: str) -> None:
    """Check every directory a reader's options will write (see ``check_writable``).

    Raises:
        DirectoryNotWritableError: One of them cannot be written.
    """
    if claim:
        where = os.path.join(root, CLAIMS_DIR, group)
        check_writable(where, "claim=True", "it records claims in " + where)
    if on_consumed != "keep":
        what = "removes" if on_consumed == "delete" else "moves"
        check_writable(root, f"on_consumed={on_consumed!r}", f"it {what} consumed samples here")
    if on_consumed == "move":
        check_writable(done_dir, "on_consumed='move'", "it moves consumed samples into it")
