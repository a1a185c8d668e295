"""The format module on its own: header codec, completeness, NaN detection, publication."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hidden_state_reader import IncompleteSampleError, load_sample, read_header
from hidden_state_reader.format import (
    LockState,
    Meta,
    WriterLock,
    has_nonfinite,
    lock_path,
    probe,
    read_status,
    sample_metadata,
    write_sample,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_detection_on_raw_bits(dtype: torch.dtype) -> None:
    x = torch.randn(64, 3, 32).to(dtype)
    x[0, 0, 0], x[1, 1, 1] = torch.finfo(dtype).max, torch.finfo(dtype).min
    assert not has_nonfinite(x)
    for value in (float("nan"), float("inf"), float("-inf"), -float("nan")):
        y = x.clone()
        y[9, 2, 17] = value
        assert has_nonfinite(y), value
    assert not has_nonfinite(x[:0])


def test_written_file_is_plain_safetensors_with_metadata(hs_dir: Path) -> None:
    tokens = torch.arange(10)
    hidden = torch.randn(10, 2, 8).to(torch.bfloat16)
    hidden[3, 1, 2] = float("nan")
    meta = sample_metadata(layer_ids=[2, 16], model="m", request_id="r", num_prompt_tokens=7)
    path = write_sample(hs_dir / "a.safetensors", tokens, hidden, metadata=meta, checksum=True)
    loaded = load_file(path)
    assert torch.equal(loaded["token_ids"], tokens)
    assert torch.equal(loaded["hidden_states"].view(torch.int16), hidden.view(torch.int16))
    header = read_header(path)
    assert header.layer_ids == [2, 16] and header.metadata[Meta.NONFINITE] == "1"
    assert len(header.metadata[Meta.CRC32]) == 8
    assert load_sample(path, None).num_tokens == 10
    assert probe(lock_path(path)) is LockState.FREE
    assert not [f for f in os.listdir(hs_dir) if ".tmp." in f]


def test_every_truncation_is_detected(hs_dir: Path) -> None:
    path = write_sample(hs_dir / "a.safetensors", torch.arange(5), torch.randn(5, 1, 4))
    blob = Path(path).read_bytes()
    for cut in range(len(blob)):
        Path(path).write_bytes(blob[:cut])
        with pytest.raises(IncompleteSampleError):
            read_header(path)


def test_writer_lock_is_held_from_the_moment_it_exists(hs_dir: Path) -> None:
    data = str(hs_dir / "a.safetensors")
    lock = WriterLock.create(data, request_id="r1")
    assert probe(lock_path(data)) is LockState.HELD
    assert read_status(lock_path(data)).detail["request_id"] == "r1"
    lock.mark_failed("disk full")
    lock.release()
    status = read_status(lock_path(data))
    assert probe(lock_path(data)) is LockState.FREE and status.failed
    assert status.reason == "disk full"


def test_writer_lock_fail_records_the_reason_and_releases_once(tmp_path: Path) -> None:
    path = str(tmp_path / "x.safetensors")
    lock = WriterLock.create(path, request_id="x")
    assert probe(lock_path(path)) is LockState.HELD
    lock.fail("disk full")
    assert not lock.held and probe(lock_path(path)) is LockState.FREE
    status = read_status(lock_path(path))
    assert status.failed and status.reason == "disk full"
    lock.fail("later reason")  # released already: the first reason stays
    assert read_status(lock_path(path)).reason == "disk full"
