"""The CLI helpers both packages share (``hidden_state_reader.cli.common``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from hidden_state_reader.cli import common
from hidden_state_reader.format import read_header, write_sample

VALUES = [
    0, 0.04, 0.5, 1, 7.25, 42.25, 99.94, 99.96, 100, 512, 999.4, 999.6, 1000, 1023, 1023.6,
    1024, 1536, 12345, 999_999, 1e6, 2.5e6, 1e9, 3.7e9, 1024**4, 5 * 1024**5, -1, -1536, -2e6,
]  # fmt: skip


def test_exit_codes() -> None:
    assert (common.EXIT_OK, common.EXIT_FAILED, common.EXIT_USAGE) == (0, 1, 2)
    assert common.EXIT_INTERRUPTED == 130 and common.EXIT_PROBLEMS == common.EXIT_FAILED


def test_formatting_examples() -> None:
    assert common.format_si(12345) == "12.3k"
    assert common.format_si(0) == "0" and common.format_si(150) == "150"
    assert common.format_bytes(1536) == "1.5 KiB" and common.format_bytes(1023.6) == "1024 B"
    assert common.format_bytes(2 * 1024**5) == "2048.0 TiB"
    assert common.format_rate(12345.6, "tok/s") == "12.3k tok/s"
    assert common.format_rate(12.6, "samples/s") == "13 samples/s"


def test_same_output_as_the_connectors_progress_helpers() -> None:
    offline = pytest.importorskip("hidden_state_connector.offline.progress")
    demo = pytest.importorskip("hidden_state_connector.demo.progress")
    for v in VALUES:
        assert common.format_si(v) == offline.format_si(v), v
        assert common.format_bytes(v) == offline.format_bytes(v), v
        assert common.format_rate(v, "tok/s") == demo.format_rate(v, "tok/s"), v


def test_isatty() -> None:
    assert common.isatty(io.StringIO()) is False
    closed = io.StringIO()
    closed.close()
    assert common.isatty(closed) is False
    assert common.isatty(object()) is False  # type: ignore[arg-type]


def test_read_token_ids(hs_dir: Path) -> None:
    path = str(hs_dir / "hs_0.safetensors")
    ids = torch.tensor([5, -3, 2**31 - 1, 0, 7])
    write_sample(path, ids, torch.zeros(5, 2, 4, dtype=torch.bfloat16))
    header = read_header(path)
    assert common.read_token_ids(path, header) == [5, -3, 2**31 - 1, 0, 7]
    assert common.read_token_ids(path, header, 2) == [5, -3]
    assert common.read_token_ids(path, header, 0) == []
    assert common.read_token_ids(path, header, 99) == [5, -3, 2**31 - 1, 0, 7]
