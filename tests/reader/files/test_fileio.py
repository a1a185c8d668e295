"""Opening sample files: regular files only, never blocking; sizes without an ``fstat``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidden_state_reader.files.fileio import NotRegularFileError, open_regular_stat, open_sized


def test_open_sized_gives_the_size_of_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"x" * 1234)
    fd, size = open_sized(str(path))
    try:
        assert size == 1234 == os.fstat(fd).st_size
        assert os.pread(fd, 4, 0) == b"xxxx"  # the size was taken without moving reads
    finally:
        os.close(fd)


def test_what_is_not_a_regular_file_fails_to_open_or_to_read(tmp_path: Path) -> None:
    """``open_sized`` does not check the type: a FIFO fails at once, a directory at the read."""
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        open_sized(str(fifo))  # no end to seek to; and the open did not block
    directory = tmp_path / "d.safetensors"
    directory.mkdir()
    fd, _ = open_sized(str(directory))
    try:
        with pytest.raises(IsADirectoryError):
            os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    for path in (fifo, directory):
        with pytest.raises(NotRegularFileError):
            open_regular_stat(str(path))
    with pytest.raises(FileNotFoundError):
        open_sized(str(tmp_path / "missing"))


def test_open_regular_stat_returns_the_stat_it_took(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"abc")
    fd, st = open_regular_stat(str(path))
    try:
        assert (st.st_size, st.st_ino) == (3, os.stat(path).st_ino)
    finally:
        os.close(fd)
