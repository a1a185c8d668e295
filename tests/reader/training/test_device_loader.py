"""HiddenStateLoader(device=...): batches equal the plain loader's, fp8 dequantized on the
device, worker slots reused and grown, exact resume, follow + claim, ranks.

CI has no GPU: ``device="cpu"`` runs the same placement code, and the shared-slot path
(built for CUDA) runs on the CPU with ``SLOT_DEVICE_TYPES`` widened, copying out of the
slots as the device copy would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_contract import check_resume_contract

import hidden_state_reader.training.loader as loader_module
from hidden_state_reader.format import fp8, sample_metadata, write_sample
from hidden_state_reader.training.collate import PackCollate, PadCollate, pack_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import make_tensors

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 17
B = 3
COLLATES = [PadCollate(pad_to_multiple_of=4), PackCollate()]


def write(root: Path, count: int = N, storage: str = "model", start: int = 0) -> None:
    for i in range(start, start + count):
        tokens, hidden = make_tensors(i, tokens=3 + (i * 5) % 11, layers=3, hidden=16)
        write_sample(
            root / f"hs_{i}.safetensors",
            tokens,
            hidden,
            metadata=sample_metadata(layer_ids=[0, 1, 2]),
            storage=storage,
        )


@pytest.fixture(params=["model", "fp8_e4m3"])
def data(hs_dir: Path, request: pytest.FixtureRequest) -> Path:
    write(hs_dir, storage=request.param)
    return hs_dir


@pytest.fixture
def slots_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the workers' shared-slot path (built for CUDA) with device="cpu"."""
    monkeypatch.setattr(loader_module, "SLOT_DEVICE_TYPES", {"cuda", "cpu"})


def make(root: Path, workers: int, collate: Any = pack_collate, **kw: Any) -> HiddenStateLoader:
    dataset_kw = {k: kw.pop(k) for k in ("rank", "world_size", "raw_fp8") if k in kw}
    ds = HiddenStateDataset(root, shuffle=True, seed=11, **dataset_kw)
    return HiddenStateLoader(ds, B, collate_fn=collate, num_workers=workers, **kw)


def assert_same_batches(expected: list[dict], got: list[dict]) -> None:
    assert len(expected) == len(got)
    for a, b in zip(expected, got, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
            else:
                assert value == b[key], key


def names(batches: list[dict]) -> list[str]:
    return [os.path.basename(p) for batch in batches for p in batch["paths"]]


@pytest.mark.parametrize("collate", COLLATES, ids=repr)
@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_equal_the_plain_loaders(data: Path, collate: Any, workers: int) -> None:
    expected = list(make(data, 0, collate))
    assert_same_batches(expected, list(make(data, workers, collate, device="cpu")))


@pytest.mark.parametrize("collate", COLLATES, ids=repr)
def test_slot_batches_equal_the_plain_loaders_pass_after_pass(
    data: Path, collate: Any, slots_on_cpu: None
) -> None:
    loader = make(data, 2, collate, device="cpu", prefetch_factor=1)
    assert loader._slots is not None and loader._slots.per_worker == 3
    reference = make(data, 0, collate)
    for _ in range(3):  # later passes reuse the slots the first one made
        assert_same_batches(list(reference), list(loader))
    made = [v for worker in loader._slots.versions for v in worker]
    assert 0 < sum(made) <= 2 * 3  # each slot made once at most (batches never outgrew)


def test_a_slot_grows_when_a_batch_outgrows_it(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir, count=6)
    loader = make(hs_dir, 1, device="cpu")
    assert_same_batches(list(make(hs_dir, 0)), list(loader))
    assert loader._slots is not None
    before = [row[:] for row in loader._slots.versions]
    # Samples 50x longer than the slots were made for: every slot used is made again.
    for i in range(6):
        tokens, hidden = make_tensors(i, tokens=2000, layers=3, hidden=16)
        write_sample(hs_dir / f"hs_{i}.safetensors", tokens, hidden, storage="model")
    loader = make(hs_dir, 1, device="cpu")
    loader._slots = loader._slots  # a fresh loader: slots made anew, then grown below
    assert_same_batches(list(make(hs_dir, 0)), list(loader))
    assert before != loader._slots.versions or all(v == 0 for v in before[0])
    sizes = [s.numel() for s in loader._slots.slots[0] if s is not None]
    assert sizes and min(sizes) >= 2000 * 3 * 16 * 2


def test_breaking_out_early_leaves_no_slot_taken(data: Path, slots_on_cpu: None) -> None:
    loader = make(data, 2, device="cpu", prefetch_factor=1)
    for i, _ in enumerate(loader):
        if i == 1:
            break  # batches built ahead are never read: their slots must not stay taken
    loader.dataset.set_epoch(1)
    rest = list(loader)
    ds = HiddenStateDataset(data, shuffle=True, seed=11)
    assert names(rest) == ds.epoch_names(1)


def test_fp8_is_dequantized_on_the_device_bit_for_bit(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir, storage="fp8_e4m3")
    raw = list(make(hs_dir, 0, raw_fp8=True))
    for workers in (0, 2):
        got = list(make(hs_dir, workers, device="cpu"))
        for r, g in zip(raw, got, strict=True):
            values = fp8.dequantize(r["hidden_states"], r["hidden_states_scales"], torch.bfloat16)
            assert "hidden_states_scales" not in g
            assert torch.equal(values, g["hidden_states"])


def test_raw_fp8_stays_raw_with_its_scales(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir, storage="fp8_e4m3")
    got = list(make(hs_dir, 2, device="cpu", raw_fp8=True))
    assert all(b["hidden_states"].dtype == torch.float8_e4m3fn for b in got)
    assert_same_batches(list(make(hs_dir, 0, raw_fp8=True)), got)


def test_a_dtype_is_applied_after_the_copy(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir, count=4)
    write(hs_dir, count=4, storage="fp8_e4m3", start=4)
    ds = HiddenStateDataset(hs_dir, dtype=torch.float32)
    plain = list(HiddenStateLoader(ds, 4))
    ds = HiddenStateDataset(hs_dir, dtype=torch.float32)
    got = list(HiddenStateLoader(ds, 4, num_workers=2, device="cpu"))
    assert [b["hidden_states"].dtype for b in got] == [torch.float32] * 2
    assert_same_batches(plain, got)


def batches_of(loader: HiddenStateLoader) -> Iterator[list[str]]:
    return ([os.path.basename(p) for p in batch["paths"]] for batch in loader)


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 3)])
def test_resume_is_exact_through_the_slots(
    hs_dir: Path, slots_on_cpu: None, before: int, after: int
) -> None:
    write(hs_dir)
    check_resume_contract(
        lambda: make(hs_dir, before, device="cpu"),
        batches_of,
        stop_after=2,
        make_resumed=lambda: make(hs_dir, after, device="cpu"),
        reference=lambda: make(hs_dir, 0),
    )


def test_ranks_split_the_epoch_through_the_slots(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir)
    per_rank = [
        names(list(make(hs_dir, 2, device="cpu", rank=r, world_size=2))) for r in range(2)
    ]
    everything = HiddenStateDataset(hs_dir).epoch_names(0)
    assert sorted(per_rank[0] + per_rank[1])[: len(everything)] <= sorted(everything * 2)
    assert set(per_rank[0]) | set(per_rank[1]) == set(everything)
    assert len(per_rank[0]) == len(per_rank[1])  # even shards


def test_follow_with_claims_and_delete_through_the_slots(hs_dir: Path, slots_on_cpu: None) -> None:
    write(hs_dir, count=12, storage="fp8_e4m3")
    ds = HiddenStateDataset(
        hs_dir, follow=True, idle_timeout=1.0, on_consumed="delete", watch="poll",
        poll_interval=0.05,
    )  # fmt: skip
    got = names(list(HiddenStateLoader(ds, 2, collate_fn=pack_collate, num_workers=2, device="cpu")))
    assert sorted(got) == sorted(f"hs_{i}.safetensors" for i in range(12))
    assert not list(hs_dir.glob("*.safetensors"))  # each deleted once used
    assert ds.state_dict()["consumed"] == 12


def test_a_collate_of_your_own_gets_its_batch_on_the_device(data: Path) -> None:
    def first_tokens(samples: list[Any]) -> torch.Tensor:
        return torch.stack([s.token_ids[:2] for s in samples])

    got = list(make(data, 2, first_tokens, device="cpu"))
    assert torch.equal(torch.cat(got), torch.cat(list(make(data, 0, first_tokens))))


def test_arguments_that_do_not_apply_are_refused(data: Path) -> None:
    with pytest.raises(ValueError, match="persistent_workers"):
        make(data, 2, device="cpu", persistent_workers=True)
    ds = HiddenStateDataset(data, device="cpu")
    with pytest.raises(ValueError, match="given to both"):
        HiddenStateLoader(ds, 2, device="cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        make(data, 0, device="no-such-device")
