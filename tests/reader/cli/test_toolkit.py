"""The CLI toolkit both packages share (``hidden_state_reader.apps.cli.toolkit``)."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from hidden_state_reader.apps.cli import common, toolkit
from hidden_state_reader.apps.cli.toolkit import format_bytes
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.publish import write_sample


def test_exit_codes() -> None:
    assert (toolkit.EXIT_OK, toolkit.EXIT_FAILED, toolkit.EXIT_USAGE) == (0, 1, 2)
    assert toolkit.EXIT_INTERRUPTED == 130 and common.EXIT_PROBLEMS == toolkit.EXIT_FAILED


def test_formatting_examples() -> None:
    assert toolkit.format_si(12345) == "12.3k"
    assert toolkit.format_si(0) == "0" and toolkit.format_si(150) == "150"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(1023.6) == "1024 B"
    assert format_bytes(2 * 1024**5) == "2.0 PiB" and format_bytes(None) == "-"
    assert toolkit.format_rate(12345.6, "tok/s") == "12.3k tok/s"
    assert toolkit.format_rate(12.6, "samples/s") == "13 samples/s"


def test_isatty() -> None:
    assert toolkit.isatty(io.StringIO()) is False
    closed = io.StringIO()
    closed.close()
    assert toolkit.isatty(closed) is False
    assert toolkit.isatty(object()) is False  # type: ignore[arg-type]


def test_read_token_ids(hs_dir: Path) -> None:
    path = str(hs_dir / "hs_0.safetensors")
    ids = torch.tensor([5, -3, 2**31 - 1, 0, 7])
    write_sample(path, ids, torch.zeros(5, 2, 4, dtype=torch.bfloat16))
    header = read_header(path)
    assert toolkit.read_token_ids(path, header) == [5, -3, 2**31 - 1, 0, 7]
    assert toolkit.read_token_ids(path, header, 2) == [5, -3]
    assert toolkit.read_token_ids(path, header, 0) == []
    assert toolkit.read_token_ids(path, header, 99) == [5, -3, 2**31 - 1, 0, 7]
