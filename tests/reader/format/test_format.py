"""The format module on its own: header codec, completeness, NaN detection, publication."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hidden_state_reader import (
    CorruptSampleError,
    IncompleteSampleError,
    LoadOptions,
    load_sample,
    read_header,
)
from hidden_state_reader.files.locks import WriterLock, probe, read_status
from hidden_state_reader.files.publish import has_nonfinite, write_sample
from hidden_state_reader.format import LockState, Meta, lock_path, sample_metadata

from samples import write_vllm_style


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
    path = write_sample(hs_dir / "a.safetensors", tokens, hidden, metadata=meta)
    loaded = load_file(path)
    assert torch.equal(loaded["token_ids"], tokens)
    assert torch.equal(loaded["hidden_states"].view(torch.int16), hidden.view(torch.int16))
    header = read_header(path)
    assert header.layer_ids == [2, 16] and header.metadata[Meta.NONFINITE] == "1"
    assert len(header.metadata[Meta.CRC32]) == 8  # on by default
    assert header.model_dtype == "BF16"
    assert load_sample(path, None).num_tokens == 10
    assert probe(lock_path(path)) is LockState.FREE
    assert not [f for f in os.listdir(hs_dir) if ".tmp." in f]


def test_crc32_is_on_by_default_and_catches_one_changed_byte(hs_dir: Path) -> None:
    path = Path(write_sample(hs_dir / "a.safetensors", torch.arange(6), torch.randn(6, 2, 8)))
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.hidden.begin + 5] ^= 0x01  # one bit of hidden_states
    path.write_bytes(bytes(data))
    load_sample(path)  # not verified unless asked (the read-side default, docs/reader.md)
    with pytest.raises(CorruptSampleError, match="CRC32 mismatch"):
        load_sample(path, LoadOptions(verify_checksum=True))
    plain = write_sample(hs_dir / "b.safetensors", torch.arange(6), torch.randn(6, 2, 8),
                         checksum=False)  # fmt: skip
    assert Meta.CRC32 not in read_header(plain).metadata


SHA = "0123456789abcdef0123456789abcdef01234567"


def test_capture_metadata_reads_back_through_the_header(hs_dir: Path) -> None:
    meta = sample_metadata(
        layer_ids=[1, 2, 4], model="org/tiny", num_hidden_layers=4, model_revision=SHA,
        vllm_version="0.32.0",
    )  # fmt: skip
    hidden = torch.randn(3, 3, 8)
    header = read_header(write_sample(hs_dir / "a.safetensors", torch.arange(3), hidden,
                                      metadata=meta, storage="fp8_e4m3"))  # fmt: skip
    assert (header.layer_ids, header.num_hidden_layers, header.captures_last_layer) == (
        [1, 2, 4], 4, True,
    )  # fmt: skip
    assert (header.model, header.model_revision, header.vllm_version, header.model_dtype) == (
        "org/tiny", SHA, "0.32.0", "F32",
    )  # fmt: skip
    short = sample_metadata(layer_ids=[1, 2], num_hidden_layers=4)
    path = write_sample(hs_dir / "b.safetensors", torch.arange(3), hidden[:, :2], metadata=short)
    assert read_header(path).captures_last_layer is False
    old = read_header(write_vllm_style(hs_dir / "c.safetensors", 0))  # no metadata at all
    assert (old.num_hidden_layers, old.captures_last_layer, old.model_revision) == (None,) * 3
    assert (old.model, old.model_dtype, old.vllm_version) == (None,) * 3


@pytest.mark.parametrize(
    ("recorded", "problem"),
    [
        ({"num_hidden_layers": "four"}, "num_hidden_layers is not a positive integer: 'four'"),
        ({"num_hidden_layers": "0"}, "num_hidden_layers is not a positive integer"),
        ({"num_hidden_layers": "4", "layer_ids": "[2, 5]"}, r"\[2, 5\] are not layers of a 4-"),
    ],
)
def test_capture_metadata_that_contradicts_itself_is_corrupt(
    hs_dir: Path, recorded: dict[str, str], problem: str
) -> None:
    meta = {"layer_ids": "[1, 2]", **recorded}
    path = write_sample(hs_dir / "a.safetensors", torch.arange(3), torch.randn(3, 2, 8),
                        metadata=meta)  # fmt: skip
    with pytest.raises(CorruptSampleError, match=problem) as caught:
        read_header(path)
    assert caught.value.path == path


def test_sample_metadata_refuses_layer_ids_the_model_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"layer ids \[2, 5\] are not layers 0..4"):
        sample_metadata(layer_ids=[2, 5], num_hidden_layers=4)
    with pytest.raises(ValueError, match="num_hidden_layers must be positive"):
        sample_metadata(num_hidden_layers=0)


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
