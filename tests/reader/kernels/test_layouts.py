"""Known tensor layouts (``kernels/layouts.py``): a header seen before concludes exactly
what the full rule does."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hidden_state_reader import CorruptSampleError, IncompleteSampleError, read_header
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import SampleHeader
from hidden_state_reader.format.header import _made, parse_header, split_metadata
from hidden_state_reader.kernels import layouts


@pytest.fixture(autouse=True)
def _no_layouts() -> Iterator[None]:
    layouts.clear()
    yield
    layouts.clear()


def _write(path: Path, index: int, tokens: int = 5, **kwargs: Any) -> str:
    gen = torch.Generator().manual_seed(index)
    hidden = torch.randn(tokens, 3, 16, generator=gen).to(torch.bfloat16)
    return write_sample(path, torch.arange(tokens) + index, hidden, **kwargs)


def _header_bytes(path: str) -> bytes:
    blob = Path(path).read_bytes()
    (length,) = struct.unpack_from("<Q", blob)
    return blob[8 : 8 + length]


def _full_rule(path: str) -> SampleHeader:
    """What the full rule concludes (nothing remembered; it remembers this one again)."""
    layouts.clear()
    return read_header(path)


def test_files_that_differ_in_metadata_share_one_validated_layout(hs_dir: Path) -> None:
    first = _write(hs_dir / "a.safetensors", 1, metadata={"request_id": "a"})
    second = _write(hs_dir / "b.safetensors", 2, metadata={"request_id": "bb", "x": "}{,"})
    assert read_header(first) == _full_rule(first)
    tail = split_metadata(_header_bytes(second))
    assert tail is not None and layouts.lookup(tail[1]) is not None  # learnt from ``first``
    known = read_header(second)
    assert known == _full_rule(second)
    assert known.metadata["x"] == "}{," and known.metadata["request_id"] == "bb"
    assert type(known.tensors) is dict and known.tensors is not read_header(second).tensors


def test_a_known_layout_still_checks_the_file_size(hs_dir: Path) -> None:
    path = _write(hs_dir / "a.safetensors", 1)
    read_header(path)
    blob = Path(path).read_bytes()
    Path(path).write_bytes(blob[:-1])
    with pytest.raises(IncompleteSampleError, match="truncated") as caught:
        read_header(path)
    assert caught.value.path == path
    Path(path).write_bytes(blob + b"\0")
    with pytest.raises(CorruptSampleError, match="1 trailing bytes"):
        read_header(path)


def test_a_known_layout_still_checks_the_metadata(hs_dir: Path) -> None:
    path = _write(hs_dir / "a.safetensors", 1, metadata={"layer_ids": "[0, 1, 2]"})
    header = _header_bytes(path)
    size = Path(path).stat().st_size
    assert parse_header(path, header, size, layouts).layer_ids == [0, 1, 2]
    for bad, problem in (
        (b'"layer_ids":"[0, 1, 2]"', b'"layer_ids":[0, 1, 2]  '),  # not a string
        (b'"layer_ids":"[0, 1, 2]"', b'"layer_ids":"[0, 1]"   '),  # not the layer axis
    ):
        changed = header.replace(bad, problem)
        assert len(changed) == len(header) and split_metadata(changed) is not None
        with pytest.raises(CorruptSampleError) as caught:
            parse_header(path, changed, size, layouts)
        with pytest.raises(CorruptSampleError) as full:
            layouts.clear()
            parse_header(path, changed, size, layouts)
        assert str(caught.value) == str(full.value)
        parse_header(path, header, size, layouts)  # the layout is known again


def test_a_second_metadata_member_is_never_taken_from_a_layout(hs_dir: Path) -> None:
    """JSON keeps the last of two equal keys: such a tail must not be reused."""
    path = _write(hs_dir / "a.safetensors", 1, metadata={"k": "first"})
    header = _header_bytes(path).rstrip(b" ")
    doubled = header[:-1] + b',"__metadata__":{"k":"last"}}'
    doubled += b" " * (-(8 + len(doubled)) % 8)
    data = Path(path).read_bytes()[8 + len(_header_bytes(path)) :]
    Path(path).write_bytes(struct.pack("<Q", len(doubled)) + doubled + data)
    for _ in range(2):  # the second parse would use a remembered layout
        assert read_header(path).metadata == {"k": "last"}
    parts = split_metadata(doubled)
    assert parts is not None and layouts.lookup(parts[1]) is None


def test_headers_in_any_other_form_take_the_full_rule(hs_dir: Path) -> None:
    path = _write(hs_dir / "a.safetensors", 1)
    doc = json.loads(_header_bytes(path))
    spaced = json.dumps(doc).encode()  # ", " and ": " separators: not the writer's form
    assert split_metadata(spaced) is None
    assert split_metadata(b'{"token_ids":{}}') is None
    assert split_metadata(b'{"__metadata__":\xff}') is None
    assert split_metadata(b'{"__metadata__": {}}') is None  # a space before the value


def test_without_a_memo_every_header_takes_the_full_rule(hs_dir: Path) -> None:
    path = _write(hs_dir / "a.safetensors", 1)
    header, size = _header_bytes(path), Path(path).stat().st_size
    assert parse_header(path, header, size) == read_header(path)
    layouts.clear()
    parse_header(path, header, size)
    parts = split_metadata(header)
    assert parts is not None and layouts.lookup(parts[1]) is None  # nothing remembered


def test_made_headers_are_the_dataclass_itself() -> None:
    args = ("p", 248, 1000, {}, {"a": "b"})
    made = _made(*args)
    assert made == SampleHeader(*args) and type(made) is SampleHeader
    with pytest.raises(AttributeError):
        made.path = "q"  # type: ignore[misc]
