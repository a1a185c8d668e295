"""HiddenStateLoader: exact order, epochs, and resume with another worker count."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_contract import check_resume_contract

from hidden_state_reader.training.collate import pack_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import write_samples

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 23
B = 4


@pytest.fixture
def data(hs_dir: Path) -> Path:
    write_samples(hs_dir, N, tokens=[2 + i % 4 for i in range(N)])
    return hs_dir


def make(
    root: Path,
    workers: int,
    batch_size: int = B,
    rank: int | None = None,
    world_size: int | None = None,
    names: list[str] | None = None,
    **loader_kw: Any,
) -> HiddenStateLoader:
    ds = HiddenStateDataset(
        root, shuffle=True, seed=17, rank=rank, world_size=world_size, names=names
    )
    return HiddenStateLoader(ds, batch_size=batch_size, num_workers=workers, **loader_kw)


def names(batch: dict) -> list[str]:
    return [os.path.basename(p) for p in batch["paths"]]


def run(loader: HiddenStateLoader) -> list[str]:
    return [n for batch in loader for n in names(batch)]


def batches(loader: HiddenStateLoader) -> Iterator[list[str]]:
    return (names(batch) for batch in loader)


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_batches_follow_the_epoch_order_and_epochs_advance(data: Path, workers: int) -> None:
    loader = make(data, workers)
    ds = loader.dataset
    assert isinstance(ds, HiddenStateDataset)
    assert len(loader) == 6  # ceil(23 / 4)
    first = run(loader)
    assert first == ds.epoch_names(0)
    assert (loader.epoch, loader.consumed) == (1, 0)  # ready for the next epoch
    second = run(loader)
    assert second == ds.epoch_names(1) != first
    # Calling set_epoch every epoch, as with DistributedSampler, agrees with that.
    ds.set_epoch(2)
    assert run(loader) == ds.epoch_names(2)


def interrupted(root: Path, workers: int, stop_after: int, **kw: Any) -> tuple[list[str], dict]:
    loader = make(root, workers, **kw)
    got: list[str] = []
    for i, batch in enumerate(loader):
        got += names(batch)
        if i + 1 == stop_after:
            # Through JSON, as a checkpoint would store it.
            return got, json.loads(json.dumps(loader.state_dict()))
    raise AssertionError("epoch ended before the interruption")


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 0), (0, 2)])
def test_resume_with_another_worker_count_continues_exactly(
    data: Path, before: int, after: int
) -> None:
    _, state = check_resume_contract(
        lambda: make(data, before),
        batches,
        stop_after=3,
        make_resumed=lambda: make(data, after),
        reference=lambda: make(data, 0),
    )
    assert state["consumed"] == 3 * B and state["epoch"] == 0


def test_resume_with_another_batch_size(data: Path) -> None:
    check_resume_contract(
        lambda: make(data, 2),
        batches,
        stop_after=2,
        make_resumed=lambda: make(data, 3, batch_size=5),
        reference=lambda: make(data, 0),
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_the_resume_contract(data: Path, rank: int) -> None:
    check_resume_contract(
        lambda: make(data, 2, rank=rank, world_size=2),
        batches,
        stop_after=1,
        make_resumed=lambda: make(data, 0, rank=rank, world_size=2),
    )


def samples_of(ds: HiddenStateDataset) -> Iterator[list[str]]:
    return ([os.path.basename(s.path)] for s in ds)


@pytest.mark.parametrize("stop_after", [1, 7, N - 1])
def test_a_dataset_iterated_directly_keeps_the_resume_contract(data: Path, stop_after: int) -> None:
    check_resume_contract(
        lambda: HiddenStateDataset(data, shuffle=True, seed=3), samples_of, stop_after=stop_after
    )


def test_break_and_iterate_again_continues_the_epoch(data: Path) -> None:
    loader = make(data, 2, persistent_workers=True)
    ds = loader.dataset
    got = []
    for i, batch in enumerate(loader):
        got += names(batch)
        if i == 1:
            break
    got += run(loader)  # persistent workers pick up the cursor too
    assert got == ds.epoch_names(0)
    assert run(loader) == ds.epoch_names(1)


def test_checkpoint_in_the_last_batch_resumes_into_the_next_epoch(data: Path) -> None:
    loader = make(data, 2)
    for _ in loader:
        state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, N)
    resumed = make(data, 3)
    resumed.load_state_dict(state)
    resumed.dataset.set_epoch(0)
    assert run(resumed) == []  # the rest of epoch 0: nothing
    assert run(resumed) == resumed.dataset.epoch_names(1)


def test_drop_last_and_len(data: Path) -> None:
    loader = make(data, 2, drop_last=True)
    assert len(loader) == N // B
    got = run(loader)
    assert got == loader.dataset.epoch_names(0)[: (N // B) * B]
    assert (loader.epoch, loader.consumed) == (1, 0)  # the pass is complete
    assert run(loader)[:B] == loader.dataset.epoch_names(1)[:B]


def test_unreadable_sample_still_counts_its_position(data: Path) -> None:
    first = make(data, 0).dataset
    epoch0 = first.epoch_names(0)
    listed = list(first._static("names").names)  # the list, taken before the sample went bad
    bad = epoch0[5]  # in the second batch
    (data / bad).write_bytes(struct.pack("<Q", 8) + b"not json")
    got, state = interrupted(data, 2, stop_after=2, names=listed)
    assert state["consumed"] == 2 * B and len(got) == 2 * B - 1
    resumed = make(data, 3, names=listed)
    resumed.load_state_dict(state)
    assert got + run(resumed) == [n for n in epoch0 if n != bad]
    assert (resumed.epoch, resumed.consumed) == (1, 0)


def test_ranks_get_equal_batch_counts_and_resume_independently(data: Path) -> None:
    seen = []
    for rank in range(3):
        got, state = interrupted(data, 2, stop_after=1, rank=rank, world_size=3, batch_size=3)
        resumed = make(data, 3, batch_size=3, rank=rank, world_size=3)
        resumed.load_state_dict(state)
        rest = [names(b) for b in resumed]
        assert len(rest) == 2  # 8 positions per rank (23 padded to 24): 3 + 3 + 2
        seen += got + [n for b in rest for n in b]
    assert sorted(set(seen)) == sorted(f"hs_{i}.safetensors" for i in range(N))
    assert len(seen) == 24


def test_custom_collate_and_pinned_batches(data: Path) -> None:
    loader = make(data, 2, collate_fn=pack_collate, pin_memory=torch.cuda.is_available())
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 1
    assert batch["cu_seqlens"].shape == (B + 1,)
    assert loader.consumed == B


def test_loader_rejects_what_would_break_the_order(data: Path) -> None:
    ds = HiddenStateDataset(data)
    for bad in ({"shuffle": True}, {"sampler": range(3)}, {"in_order": False}):
        with pytest.raises(ValueError):
            HiddenStateLoader(ds, batch_size=2, **bad)
    with pytest.raises(TypeError, match="HiddenStateDataset"):
        HiddenStateLoader(list(range(3)), batch_size=2)  # type: ignore[arg-type]
