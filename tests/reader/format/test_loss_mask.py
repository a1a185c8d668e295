"""The optional ``loss_mask`` tensor: written, validated, loaded, collated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hidden_state_reader import (
    CorruptSampleError,
    HiddenStateReader,
    Sample,
    load_sample,
    read_header,
)
from hidden_state_reader.files.locks import read_status
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import LOSS_MASK, lock_path
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.load import MMAP_MIN_BYTES
from hidden_state_reader.training.collate import PackCollate, PadCollate, pack_collate, pad_collate

from samples import make_tensors

MASK = [0, 0, 0, 1, 1, 0, 1, 1, 1, 0]


def _write(path: Path, mask: object, *, tokens: int = 10, **kwargs: object) -> str:
    ids, hidden = make_tensors(3, tokens, 2, 8)
    return write_sample(path, ids, hidden, loss_mask=mask, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given",
    [MASK, [bool(v) for v in MASK], torch.tensor(MASK), torch.tensor(MASK, dtype=torch.bool)],
    ids=["ints", "bools", "int64-tensor", "bool-tensor"],
)
def test_mask_round_trips_as_u8_on_disk_and_bool_in_the_sample(hs_dir: Path, given: object) -> None:
    path = _write(hs_dir / "a.safetensors", given, checksum=True)
    on_disk = load_file(path)[LOSS_MASK]  # plain safetensors: any reader finds it
    assert on_disk.dtype == torch.uint8 and on_disk.tolist() == MASK
    header = read_header(path)
    assert header.loss_mask is not None and header.loss_mask.dtype == "U8"
    sample = load_sample(path, LoadOptions(verify_checksum=True))  # CRC covers the mask
    assert sample.loss_mask is not None and sample.loss_mask.dtype == torch.bool
    assert sample.loss_mask.tolist() == [bool(v) for v in MASK]
    ids, hidden = make_tensors(3, 10, 2, 8)
    assert torch.equal(sample.token_ids, ids) and torch.equal(sample.hidden_states, hidden)
    assert sample.nbytes == ids.numel() * 8 + hidden.numel() * 2 + 10
    assert "loss_mask=5 trained" in repr(sample)


def test_mask_is_a_view_and_ignores_layer_and_dtype_options(hs_dir: Path) -> None:
    # Large enough to be mapped: the mask is a view into the same mapping.
    tokens = MMAP_MIN_BYTES // (2 * 8 * 2) + 1
    mask = [i % 3 == 0 for i in range(tokens)]
    path = _write(hs_dir / "big.safetensors", mask, tokens=tokens)
    options = LoadOptions(layers=[-1], dtype=torch.float32)
    sample = load_sample(path, options)
    assert sample.hidden_states.shape == (tokens, 1, 8)
    assert sample.hidden_states.dtype == torch.float32
    assert sample.loss_mask is not None and sample.loss_mask.tolist() == mask
    header = read_header(path)
    assert header.loss_mask is not None
    # Both are views of the one mapped file, at the header's offsets (no copy).
    assert (
        sample.loss_mask.data_ptr() - sample.token_ids.data_ptr()
        == header.loss_mask.begin - header.tokens.begin
    )
    copied = load_sample(path, LoadOptions(mmap=False))
    assert copied.loss_mask is not None and torch.equal(copied.loss_mask, sample.loss_mask)


def test_files_without_a_mask_load_with_none(hs_dir: Path) -> None:
    ids, hidden = make_tensors(0, 9, 2, 8)
    path = write_sample(hs_dir / "plain.safetensors", ids, hidden)
    assert read_header(path).loss_mask is None
    sample = load_sample(path)
    assert sample.loss_mask is None and "loss_mask" not in repr(sample)


def test_bool_masks_of_other_writers_are_accepted(hs_dir: Path) -> None:
    ids, hidden = make_tensors(1, 10, 2, 8)
    path = hs_dir / "foreign.safetensors"
    mask = torch.tensor(MASK, dtype=torch.bool)
    save_file({"hidden_states": hidden, "token_ids": ids, LOSS_MASK: mask}, str(path))
    sample = load_sample(path)
    assert sample.loss_mask is not None and torch.equal(sample.loss_mask, mask)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.tensor(MASK, dtype=torch.int64), "loss_mask has dtype I64; it must be U8 or BOOL"),
        (torch.ones(11, dtype=torch.uint8), r"loss_mask has shape \[11\]; it must be \[10\]"),
        (torch.ones(10, 1, dtype=torch.uint8), r"loss_mask has shape \[10, 1\]"),
    ],
    ids=["int64", "too-long", "2-D"],
)
def test_bad_mask_headers_are_corrupt_naming_the_file(
    hs_dir: Path, mask: torch.Tensor, message: str
) -> None:
    ids, hidden = make_tensors(1, 10, 2, 8)
    path = hs_dir / "bad.safetensors"
    save_file({"hidden_states": hidden, "token_ids": ids, LOSS_MASK: mask}, str(path))
    with pytest.raises(CorruptSampleError, match=message) as caught:
        read_header(path)
    assert str(path) in str(caught.value)


def test_mask_bytes_other_than_0_and_1_are_corrupt_on_load(hs_dir: Path) -> None:
    ids, hidden = make_tensors(1, 10, 2, 8)
    path = hs_dir / "twos.safetensors"
    mask = torch.tensor(MASK, dtype=torch.uint8)
    mask[4] = 2
    save_file({"hidden_states": hidden, "token_ids": ids, LOSS_MASK: mask}, str(path))
    read_header(path)  # the header alone cannot tell
    with pytest.raises(CorruptSampleError, match=r"loss_mask\[4\] is 2") as caught:
        load_sample(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (MASK[:-1], r"shape \[9\], expected \[10\]"),
        ([0, 2, *MASK[2:]], "only 0 and 1"),
        (torch.tensor(MASK, dtype=torch.float32), "bool or integer"),
        (["1"] * 10, "only 0 and 1"),
    ],
    ids=["short", "two", "float", "strings"],
)
def test_writer_refuses_bad_masks_and_publishes_nothing(
    hs_dir: Path, mask: object, message: str
) -> None:
    path = hs_dir / "w.safetensors"
    with pytest.raises(ValueError, match=message) as caught:
        _write(path, mask)
    assert str(path) in str(caught.value)
    assert not path.exists() and read_status(lock_path(str(path))).failed
    assert os.listdir(hs_dir) == ["w.safetensors.lock"]


def _samples(hs_dir: Path) -> list[Sample]:
    """Three samples of lengths 4, 6, 3: masked, unmasked, masked."""
    masks = {0: [0, 1, 1, 0], 2: [1, 0, 1]}
    for i, n in enumerate([4, 6, 3]):
        ids, hidden = make_tensors(i, n, 2, 8)
        write_sample(hs_dir / f"hs_{i}.safetensors", ids, hidden, loss_mask=masks.get(i))
    return list(HiddenStateReader(hs_dir))


def test_pad_collate_carries_masks_and_counts_every_token_of_unmasked_samples(
    hs_dir: Path,
) -> None:
    batch = _samples(hs_dir)
    assert [s.loss_mask is not None for s in batch] == [True, False, True]
    out = pad_collate(batch)
    assert out["loss_mask"].dtype == torch.bool and out["loss_mask"].shape == (3, 6)
    assert out["loss_mask"].int().tolist() == [
        [0, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 0, 1, 0, 0, 0],
    ]
    assert torch.equal(out["loss_mask"][1], out["attention_mask"][1])
    assert out["has_loss_mask"].tolist() == [True, False, True]
    cut = PadCollate(max_length=2, pad_to_multiple_of=2)(batch)
    assert cut["loss_mask"].int().tolist() == [[0, 1], [1, 1], [1, 0]]


def test_pack_collate_carries_masks_in_pack_order(hs_dir: Path) -> None:
    batch = _samples(hs_dir)
    out = pack_collate(batch)
    assert out["loss_mask"].shape == (1, 13)
    assert out["loss_mask"][0].int().tolist() == [0, 1, 1, 0] + [1] * 6 + [1, 0, 1]
    assert out["has_loss_mask"].tolist() == [True, False, True]
    budget = PackCollate(max_tokens=5)(batch)
    assert budget["loss_mask"][0].int().tolist() == [0, 1, 1, 0, 1]


def test_plain_pairs_have_no_mask_and_bad_sample_masks_are_named() -> None:
    pairs = [make_tensors(i, n, 2, 4) for i, n in enumerate([3, 2])]
    out = pad_collate(pairs)
    assert torch.equal(out["loss_mask"], out["attention_mask"])
    assert out["has_loss_mask"].tolist() == [False, False]
    ids, hidden = pairs[0]
    as_ints = Sample(ids, hidden, "x.safetensors", loss_mask=torch.tensor([1, 0, 1]))
    assert pad_collate([as_ints])["loss_mask"][0].tolist() == [True, False, True]
    bad = Sample(ids, hidden, "x.safetensors", loss_mask=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"x\.safetensors: loss_mask must be a \[3\] tensor"):
        pack_collate([bad])
    twos = Sample(ids, hidden, "y.safetensors", loss_mask=torch.tensor([1, 2, 0]))
    with pytest.raises(ValueError, match=r"y\.safetensors: loss_mask must be bool or hold only"):
        pad_collate([twos])


def test_inspect_shows_how_many_tokens_the_mask_trains(
    hs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hidden_state_reader.apps.cli import main as cli_main

    path = _write(hs_dir / "a.safetensors", MASK)
    assert cli_main.main(["inspect", path, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "loss mask:   5 of 10 tokens trained" in out and "loss_mask" in out
    ids, hidden = make_tensors(0, 4, 2, 8)
    plain = write_sample(hs_dir / "b.safetensors", ids, hidden)
    assert cli_main.main(["inspect", plain]) == 0
    assert "loss mask:   none" in capsys.readouterr().out
