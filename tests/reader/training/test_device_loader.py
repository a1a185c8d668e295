"""HiddenStateLoader(device=...): batches equal the plain loader's, fp8 dequantized on the
device, exact resume, follow + claim, ranks, early stops, host buffers reused.

CI has no GPU: ``device="cpu"`` runs the same builder threads and placement code (batches
built in fresh memory, where CUDA builds them in reused page-locked buffers:
``HostArenas``, tested on its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_contract import check_resume_contract

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata
from hidden_state_reader.kernels.fp8 import dequantize
from hidden_state_reader.training.collate import PackCollate, PadCollate, pack_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.device_feed.host_build import HostArenas
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


def test_breaking_out_early_stops_the_threads_and_the_next_pass_starts_clean(
    data: Path,
) -> None:
    import threading

    loader = make(data, 2, device="cpu", prefetch_factor=1)
    batches = iter(loader)
    next(batches)
    next(batches)
    batches.close()  # the loop broke out: the builder threads end (batches built ahead too)
    assert not [t for t in threading.enumerate() if t.name.startswith("hidden-state-feed")]
    loader.dataset.set_epoch(1)
    rest = list(loader)
    ds = HiddenStateDataset(data, shuffle=True, seed=11)
    assert names(rest) == ds.epoch_names(1)


def test_fp8_is_dequantized_on_the_device_bit_for_bit(hs_dir: Path) -> None:
    write(hs_dir, storage="fp8_e4m3")
    raw = list(make(hs_dir, 0, raw_fp8=True))
    for workers in (0, 2):
        got = list(make(hs_dir, workers, device="cpu"))
        for r, g in zip(raw, got, strict=True):
            values = dequantize(r["hidden_states"], r["hidden_states_scales"], torch.bfloat16)
            assert "hidden_states_scales" not in g
            assert torch.equal(values, g["hidden_states"])


def test_raw_fp8_stays_raw_with_its_scales(hs_dir: Path) -> None:
    write(hs_dir, storage="fp8_e4m3")
    got = list(make(hs_dir, 2, device="cpu", raw_fp8=True))
    assert all(b["hidden_states"].dtype == torch.float8_e4m3fn for b in got)
    assert_same_batches(list(make(hs_dir, 0, raw_fp8=True)), got)


def test_a_dtype_is_applied_after_the_copy(hs_dir: Path) -> None:
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
def test_resume_is_exact_with_device(hs_dir: Path, before: int, after: int) -> None:
    write(hs_dir)
    check_resume_contract(
        lambda: make(hs_dir, before, device="cpu"),
        batches_of,
        stop_after=2,
        make_resumed=lambda: make(hs_dir, after, device="cpu"),
        reference=lambda: make(hs_dir, 0),
    )


def test_ranks_split_the_epoch_with_device(hs_dir: Path) -> None:
    write(hs_dir)
    per_rank = [names(list(make(hs_dir, 2, device="cpu", rank=r, world_size=2))) for r in range(2)]
    for rank, got in enumerate(per_rank):  # each rank's share, in its order
        assert got == names(list(make(hs_dir, 0, rank=rank, world_size=2)))
    assert set(per_rank[0]) | set(per_rank[1]) == set(HiddenStateDataset(hs_dir).epoch_names(0))
    assert len(per_rank[0]) == len(per_rank[1])  # even shards


def test_follow_with_claims_and_delete_with_device(hs_dir: Path) -> None:
    write(hs_dir, count=12, storage="fp8_e4m3")
    ds = HiddenStateDataset(
        hs_dir, follow=True, idle_timeout=1.0, on_consumed="delete", watch="poll",
        poll_interval=0.05,
    )  # fmt: skip
    got = names(
        list(HiddenStateLoader(ds, 2, collate_fn=pack_collate, num_workers=2, device="cpu"))
    )
    assert sorted(got) == sorted(f"hs_{i}.safetensors" for i in range(12))
    assert not list(hs_dir.glob("*.safetensors"))  # each deleted once used
    assert ds.state_dict()["consumed"] == 12


def test_a_collate_of_your_own_gets_its_batch_on_the_device(data: Path) -> None:
    def first_tokens(samples: list[Any]) -> torch.Tensor:
        return torch.stack([s.token_ids[:2] for s in samples])

    got = list(make(data, 2, first_tokens, device="cpu"))
    assert torch.equal(torch.cat(got), torch.cat(list(make(data, 0, first_tokens))))


def test_arguments_that_do_not_apply_are_refused(data: Path) -> None:
    with pytest.raises(ValueError, match="multiprocessing_context only apply"):
        make(data, 2, device="cpu", multiprocessing_context="spawn")
    ds = HiddenStateDataset(data, device="cpu")
    with pytest.raises(ValueError, match="given to both"):
        HiddenStateLoader(ds, 2, device="cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        make(data, 0, device="no-such-device")


def test_host_buffers_are_reused_and_grown() -> None:
    arenas = HostArenas(2, pin=False)
    small = [("a", (4, 8), torch.bfloat16), ("b", (3,), torch.int64)]
    first = arenas.allocate(small)
    arenas.copied(None)
    second = arenas.allocate(small)
    arenas.copied(None)
    again = arenas.allocate(small)  # the first buffer's turn again: the same memory
    arenas.copied(None)
    assert again["a"].data_ptr() == first["a"].data_ptr() != second["a"].data_ptr()
    assert (again["b"].data_ptr() - again["a"].data_ptr()) % 256 == 0  # aligned in its buffer
    big = arenas.allocate([("a", (400, 8), torch.bfloat16)])  # outgrows its buffer
    assert big["a"].shape == (400, 8) and big["a"].data_ptr() != second["a"].data_ptr()
