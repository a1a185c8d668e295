"""What happens to a sample's files after it was yielded, or rejected.

``keep`` leaves everything (the default: the reader does not own the directory);
``delete`` removes the data and lock files; ``move`` renames the data file into a done
folder. A rejected file is moved to ``.quarantine/`` with a ``.reason`` note, but only
when the reader owns the files (claim mode, or ``delete``/``move``): a plain reader never
touches what it did not consume.
"""

from __future__ import annotations

import contextlib
import os

from hidden_state_reader.files.atomic import move, write_atomic
from hidden_state_reader.format.names import QUARANTINE_DIR, lock_path

ACTIONS = ("keep", "delete", "move")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def dispose(root: str, name: str, action: str, done_dir: str | None) -> bool:
    """Apply ``action`` to a consumed sample.

    Returns:
        True if the sample's files left the storage root (so its name may be forgotten).
    """
    if action == "keep":
        return False
    data = os.path.join(root, name)
    if action == "move":
        assert done_dir is not None
        target = os.path.join(done_dir, name)
        try:
            move(data, target)
        except FileNotFoundError:
            if not os.path.exists(target):  # not a repeat of a move already made
                raise
    else:
        _unlink(data)
    _unlink(lock_path(data))
    return True


def quarantine(root: str, name: str, reason: str) -> str | None:
    """Move a rejected sample aside, with a note saying why; drop its lock file.

    Returns:
        Where the data file went, or None if there was none.
    """
    data = os.path.join(root, name)
    target_dir = os.path.join(root, QUARANTINE_DIR)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, name)
    moved: str | None = target
    try:
        move(data, target)
    except FileNotFoundError:
        moved = None
    write_atomic(target + ".reason", (reason + "\n").encode())
    _unlink(lock_path(data))
    return moved
