"""Padding and packing collation (hidden_state_reader.training.collate) on real samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hidden_state_reader import HiddenStateReader, Sample
from hidden_state_reader.training.collate import PackCollate, PadCollate, pack_collate, pad_collate

from samples import make_tensors, write_samples

LENGTHS = [3, 5, 2]


@pytest.fixture
def batch(hs_dir: Path) -> list[Sample]:
    write_samples(hs_dir, len(LENGTHS), tokens=LENGTHS, layers=3, hidden=8)
    return list(HiddenStateReader(hs_dir))


def test_pad_shapes_mask_and_values(batch: list[Sample]) -> None:
    out = PadCollate(pad_token_id=-1)(batch)
    assert out["input_ids"].shape == (3, 5) and out["input_ids"].dtype == torch.int64
    assert out["hidden_states"].shape == (3, 5, 3, 8)
    assert out["hidden_states"].dtype == torch.bfloat16
    assert out["attention_mask"].dtype == torch.bool
    assert out["lengths"].tolist() == LENGTHS
    assert out["paths"] == [s.path for s in batch]
    for row, n in enumerate(LENGTHS):
        tokens, hidden = make_tensors(row, n, 3, 8)
        assert out["attention_mask"][row].tolist() == [True] * n + [False] * (5 - n)
        assert torch.equal(out["input_ids"][row, :n], tokens)
        assert (out["input_ids"][row, n:] == -1).all()
        assert torch.equal(out["hidden_states"][row, :n], hidden)
        assert (out["hidden_states"][row, n:] == 0).all()


def test_pad_to_multiple_and_truncate(batch: list[Sample]) -> None:
    out = PadCollate(pad_to_multiple_of=4)(batch)
    assert out["input_ids"].shape == (3, 8)
    assert out["attention_mask"].sum(1).tolist() == LENGTHS
    cut = PadCollate(max_length=4)(batch)
    assert cut["input_ids"].shape == (3, 4)
    assert cut["lengths"].tolist() == [3, 4, 2]
    assert torch.equal(cut["hidden_states"][1], batch[1].hidden_states[:4])
    with pytest.raises(ValueError, match="multiple"):
        PadCollate(pad_to_multiple_of=8, max_length=12)


def test_plain_pairs_are_accepted() -> None:
    pairs = [make_tensors(i, n, 2, 4, torch.float32) for i, n in enumerate([4, 1])]
    out = pad_collate(pairs)
    assert out["paths"] == ["", ""]
    assert torch.equal(out["hidden_states"][0], pairs[0][1])
    packed = pack_collate([(t.to(torch.int32), h) for t, h in pairs])
    assert packed["input_ids"].dtype == torch.int64
    assert packed["input_ids"][0].tolist() == pairs[0][0].tolist() + pairs[1][0].tolist()


def test_pack_boundaries_positions_and_values(batch: list[Sample]) -> None:
    out = PackCollate()(batch)
    total = sum(LENGTHS)
    assert out["input_ids"].shape == (1, total)
    assert out["hidden_states"].shape == (1, total, 3, 8)
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert out["max_seqlen"] == 5
    assert out["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert out["seq_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert out["lengths"].tolist() == LENGTHS
    assert out["paths"] == [s.path for s in batch]
    bounds = out["cu_seqlens"].tolist()
    for i, sample in enumerate(batch):
        a, b = bounds[i], bounds[i + 1]
        assert torch.equal(out["input_ids"][0, a:b], sample.token_ids)
        assert torch.equal(out["hidden_states"][0, a:b], sample.hidden_states)


def test_pack_and_pad_hold_the_same_tokens(batch: list[Sample]) -> None:
    padded, packed = pad_collate(batch), pack_collate(batch)
    mask = padded["attention_mask"]
    assert torch.equal(padded["hidden_states"][mask], packed["hidden_states"][0])
    assert torch.equal(padded["input_ids"][mask], packed["input_ids"][0])


def test_pack_token_budget_truncates_the_tail(batch: list[Sample]) -> None:
    out = PackCollate(max_tokens=6)(batch)
    assert out["lengths"].tolist() == [3, 3, 0]
    assert out["cu_seqlens"].tolist() == [0, 3, 6, 6]
    assert out["input_ids"].shape == (1, 6)
    assert out["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2]
    assert len(out["paths"]) == 3


def test_layer_selection_flows_into_batches(hs_dir: Path) -> None:
    write_samples(hs_dir, 2, tokens=[2, 3], layers=4, hidden=8, layer_ids=[3, 7, 11, 15])
    samples = list(HiddenStateReader(hs_dir, layer_ids=[15, 3], dtype=torch.float32))
    out = pack_collate(samples)
    assert out["hidden_states"].shape == (1, 5, 2, 8)
    assert out["hidden_states"].dtype == torch.float32
    _, hidden = make_tensors(0, 2, 4, 8)
    assert torch.equal(out["hidden_states"][0, :2], hidden[:, [3, 0]].float())


def test_empty_batch_is_an_error() -> None:
    for collate in (pad_collate, pack_collate):
        with pytest.raises(ValueError, match="empty batch"):
            collate([])


def test_mismatched_samples_name_their_files(hs_dir: Path) -> None:
    write_samples(hs_dir, 1, hidden=8, prefix="narrow_")
    write_samples(hs_dir, 1, hidden=16, prefix="wide_")
    write_samples(hs_dir, 1, layers=2, hidden=8, prefix="shallow_")
    write_samples(hs_dir, 1, hidden=8, prefix="half_", dtype=torch.float16)
    by = {Path(s.path).name.split("_")[0]: s for s in HiddenStateReader(hs_dir)}
    for other in ("wide", "shallow"):
        for collate in (pad_collate, pack_collate):
            with pytest.raises(ValueError, match=r"\[layers, hidden\]") as err:
                collate([by["narrow"], by[other]])
            assert by["narrow"].path in str(err.value) and by[other].path in str(err.value)
    with pytest.raises(ValueError, match="dtype") as err:
        pad_collate([by["narrow"], by["half"]])
    assert by["half"].path in str(err.value)


def test_malformed_items_are_rejected() -> None:
    with pytest.raises(TypeError, match="batch item 0"):
        pad_collate([torch.zeros(3)])
    with pytest.raises(ValueError, match="batch item 1: 3 token ids but 2"):
        pad_collate([make_tensors(0, 2), (torch.arange(3), torch.zeros(2, 3, 16))])
    with pytest.raises(ValueError, match="1-D integer"):
        pack_collate([(torch.zeros(2), torch.zeros(2, 1, 4))])


def test_module_level_collates_use_defaults() -> None:
    assert isinstance(pad_collate, PadCollate) and pad_collate.pad_token_id == 0
    assert pad_collate.max_length is None and pad_collate.pad_to_multiple_of is None
    assert isinstance(pack_collate, PackCollate) and pack_collate.max_tokens is None


@pytest.mark.parametrize("collate", [PadCollate(pad_to_multiple_of=4), PackCollate()], ids=repr)
def test_raw_fp8_batches_carry_their_scales(hs_dir: Path, collate: Any) -> None:
    from hidden_state_reader.files.publish import write_sample
    from hidden_state_reader.kernels import fp8

    for i, n in enumerate(LENGTHS):
        tokens, hidden = make_tensors(i, n, 3, 8)
        write_sample(hs_dir / f"hs_{i}.safetensors", tokens, hidden, storage="fp8_e4m3")
    raw = collate(sorted(HiddenStateReader(hs_dir, raw_fp8=True), key=lambda s: s.path))
    values = collate(sorted(HiddenStateReader(hs_dir), key=lambda s: s.path))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert raw["hidden_states_scales"].shape == (*raw["hidden_states"].shape[:3], 1)
    # Dequantizing the batch gives what dequantizing each sample gives, padding zero.
    got = fp8.dequantize(raw["hidden_states"], raw["hidden_states_scales"], torch.bfloat16)
    assert torch.equal(got, values["hidden_states"])


def test_fp8_codes_without_scales_are_refused() -> None:
    tokens = torch.arange(4)
    codes = torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="without their scales"):
        pad_collate([(tokens, codes)])


def test_samples_with_other_scale_layouts_are_refused() -> None:
    tokens = torch.arange(4)
    codes = torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn)
    per_layer = Sample(tokens, codes, "a", hidden_states_scales=torch.ones(4, 2, 1))
    per_token = Sample(tokens, codes, "b", hidden_states_scales=torch.ones(4, 1, 1))
    with pytest.raises(ValueError, match="different scale layouts"):
        pack_collate([per_layer, per_token])
    wrong = Sample(tokens, codes, "c", hidden_states_scales=torch.ones(3, 2, 1))
    with pytest.raises(ValueError, match="do not fit"):
        pad_collate([wrong])
