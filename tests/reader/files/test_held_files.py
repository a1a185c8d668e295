"""Files whose ``flock`` says who holds them (``files/held_files.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidden_state_reader.files.held_files import (
    create_locked,
    is_held,
    lock_unheld,
    unlink_unheld,
)


def test_a_file_appears_held_and_filled_and_only_once(tmp_path: Path) -> None:
    path = str(tmp_path / "m")
    fd = create_locked(path, lambda fd: os.write(fd, b"me"), root=str(tmp_path))
    assert fd is not None
    try:
        assert Path(path).read_bytes() == b"me" and is_held(path)
        assert create_locked(path, lambda fd: None, root=str(tmp_path)) is None
        assert os.listdir(tmp_path) == ["m"]  # no temporary name left
        with pytest.raises(BlockingIOError):
            lock_unheld(path)
        assert not unlink_unheld(path) and os.path.exists(path)
    finally:
        os.close(fd)
    assert not is_held(path)  # its holder let go (as the kernel does for a dead one)


def test_a_free_file_is_taken_over_or_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "m")
    Path(path).write_bytes(b"")
    fd = lock_unheld(path)
    assert fd is not None and is_held(path)
    os.close(fd)
    assert unlink_unheld(path) and not os.path.exists(path)
    assert lock_unheld(path) is None and not unlink_unheld(path) and not is_held(path)


def test_a_folder_removed_below_the_root_is_made_again(tmp_path: Path) -> None:
    path = str(tmp_path / "group" / "m")
    fd = create_locked(path, lambda fd: None, root=str(tmp_path))
    assert fd is not None and is_held(path)
    os.close(fd)
    with pytest.raises(FileNotFoundError):
        create_locked(str(tmp_path / "gone" / "x" / "m"), lambda fd: None, root="/nonexistent")
