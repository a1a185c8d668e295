"""Publishing by rename (``files/atomic.py``): a reader never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidden_state_reader.files.atomic import move, publish_directory, write_atomic


def test_a_file_is_written_whole_and_replaces_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_atomic(str(path), b"first")
    write_atomic(str(path), b"second", fsync=True)
    assert path.read_bytes() == b"second" and os.listdir(tmp_path) == ["r.json"]
    write_atomic(str(path), lambda fd: os.write(fd, b"by descriptor"))
    assert path.read_bytes() == b"by descriptor"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(b"old")

    def fail(fd: int) -> None:
        os.write(fd, b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(str(path), fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["r.json"]
    with pytest.raises(FileNotFoundError):
        write_atomic(str(tmp_path / "missing" / "r.json"), b"x")


def test_moves_and_directories_go_into_place(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    move(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == b"a" and not (tmp_path / "a").exists()
    with pytest.raises(FileNotFoundError):
        move(str(tmp_path / "a"), str(tmp_path / "c"))
    staging, target = tmp_path / "staging", tmp_path / "out"
    staging.mkdir()
    (staging / "f").write_bytes(b"f")
    target.mkdir()  # an empty folder is replaced
    publish_directory(str(staging), str(target))
    assert (target / "f").read_bytes() == b"f" and not staging.exists()
    staging.mkdir()
    with pytest.raises(OSError):
        publish_directory(str(staging), str(target))  # not empty: fails loudly
