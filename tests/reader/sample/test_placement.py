"""The ``device`` option: tensors moved as stored, then converted there; same values as the CPU.

CI has no GPU, so the path is run with ``device="cpu"`` (the move is a no-op there, the
rest is the same code) and with ``"meta"`` for a real move to another device; the CUDA
branch (pinned staging) is checked on a GPU host with
``python -m benchmarks.consume --check-device cuda``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.consume import check_device
from hidden_state_reader import (
    HiddenStateDataset,
    HiddenStateLoader,
    HiddenStateReader,
    LoadOptions,
)
from hidden_state_reader.files.publish import write_sample


def _write(hs_dir: Path) -> list[Path]:
    x = torch.randn(40, 3, 64).bfloat16()
    mask = torch.arange(40) % 2 == 0
    return [
        write_sample(hs_dir / f"{s}.safetensors", torch.arange(40), x, storage=s, loss_mask=mask)
        for s in ("model", "fp8_e4m3")
    ]


def test_reader_with_device_cpu_gives_identical_tensors(hs_dir: Path) -> None:
    _write(hs_dir)
    plain = {s.path: s for s in HiddenStateReader(hs_dir)}
    for dtype in (None, torch.float32):
        moved = list(HiddenStateReader(hs_dir, device="cpu", dtype=dtype))
        assert len(moved) == 2
        for s in moved:
            ref = plain[s.path]
            want = ref.hidden_states if dtype is None else ref.hidden_states.float()
            if dtype is not None and "fp8" in s.path:
                want = HiddenStateReader(hs_dir, dtype=dtype, names=["fp8_e4m3.safetensors"])
                want = next(iter(want)).hidden_states
            assert torch.equal(s.hidden_states, want) and s.hidden_states.dtype == want.dtype
            assert torch.equal(s.token_ids, ref.token_ids)
            assert s.loss_mask is not None and torch.equal(s.loss_mask, ref.loss_mask)
            assert s.hidden_states_scales is None


def test_meta_device_moves_fp8_as_stored_and_dequantizes_there(hs_dir: Path) -> None:
    _write(hs_dir)
    for s in HiddenStateReader(hs_dir, device="meta"):
        assert s.hidden_states.device.type == "meta" and s.token_ids.device.type == "meta"
        assert s.hidden_states.dtype == torch.bfloat16 and s.hidden_states.shape == (40, 3, 64)
    raw = next(iter(HiddenStateReader(hs_dir, device="meta", raw_fp8=True,
                                      names=["fp8_e4m3.safetensors"])))  # fmt: skip
    assert raw.hidden_states.dtype == torch.float8_e4m3fn
    assert raw.hidden_states_scales is not None and raw.hidden_states_scales.device.type == "meta"


def test_bad_devices_are_refused_at_construction(hs_dir: Path) -> None:
    with pytest.raises(ValueError, match="not a torch device"):
        HiddenStateReader(hs_dir, device="gpu0")
    with pytest.raises(ValueError, match="not a torch device"):
        LoadOptions(device="nonsense:3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            HiddenStateDataset(hs_dir, device="cuda")


def test_dataset_and_loader_take_the_option_and_refuse_workers_off_the_cpu(hs_dir: Path) -> None:
    _write(hs_dir)
    loader = HiddenStateLoader(HiddenStateDataset(hs_dir, device="cpu"), batch_size=2)
    batch = next(iter(loader))
    assert batch["hidden_states"].shape == (2, 40, 3, 64)
    with pytest.raises(ValueError, match="worker processes cannot use the device"):
        HiddenStateLoader(HiddenStateDataset(hs_dir, device="meta"), num_workers=1)


def test_the_integrators_device_check_passes_on_the_cpu(tmp_path: Path) -> None:
    result = check_device("cpu", tmp_path)
    assert result["model"]["identical"] and result["fp8_e4m3"]["identical"]
