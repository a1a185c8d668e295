"""HiddenStateDataset on real files, with real DataLoader workers and real processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_contract import check_resume_contract
from torch.utils.data import DataLoader

from hidden_state_reader.training.collate import pad_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.loader import HiddenStateLoader

from procs import run_ranks
from samples import make_tensors, write_samples

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 22
TOKENS = [2 + i % 5 for i in range(N)]


@pytest.fixture
def data(hs_dir: Path) -> Path:
    write_samples(hs_dir, N, tokens=TOKENS)
    return hs_dir


def names_in(batches: list[dict]) -> list[str]:
    return [os.path.basename(p) for b in batches for p in b["paths"]]


def test_static_iteration_reads_every_sample_in_natural_order(data: Path) -> None:
    ds = HiddenStateDataset(data)
    samples = list(ds)
    assert len(ds) == N == ds.num_samples
    assert [os.path.basename(s.path) for s in samples] == [f"hs_{i}.safetensors" for i in range(N)]
    for i, (token_ids, hidden_states) in enumerate(samples):
        expected_tokens, expected_hidden = make_tensors(i, TOKENS[i])
        assert torch.equal(token_ids, expected_tokens)
        assert torch.equal(hidden_states, expected_hidden)


def test_shuffle_is_seeded_and_changes_each_epoch(data: Path) -> None:
    a, b = (
        HiddenStateDataset(data, shuffle=True, seed=3),
        HiddenStateDataset(data, shuffle=True, seed=3),
    )
    assert a.epoch_names() == b.epoch_names()
    assert [os.path.basename(s.path) for s in a] == a.epoch_names(0)
    assert (a.epoch, a.consumed) == (1, 0)  # a complete pass moves to the next epoch
    assert [os.path.basename(s.path) for s in a] == b.epoch_names(1) != b.epoch_names(0)
    assert a.epoch == 2
    assert sorted(b.epoch_names(1)) == sorted(b.epoch_names(0))
    assert HiddenStateDataset(data, shuffle=True, seed=4).epoch_names() != a.epoch_names(0)


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_deliver_the_global_order_when_batch_size_is_the_chunk(
    data: Path, workers: int
) -> None:
    ds = HiddenStateDataset(data, shuffle=True, seed=1, batch_size=4)
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pad_collate)
    assert names_in(list(loader)) == ds.epoch_names(0)


def test_ranks_and_workers_split_an_epoch_exactly_once(data: Path) -> None:
    seen = []
    for rank in range(3):
        ds = HiddenStateDataset(
            data, shuffle=True, rank=rank, world_size=3, even_shards=False, batch_size=2
        )
        loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=pad_collate)
        got = names_in(list(loader))
        assert got == ds.epoch_names() and len(got) == len(ds)
        seen += got
    assert sorted(seen) == sorted(f"hs_{i}.safetensors" for i in range(N))


def test_even_shards_give_every_rank_the_same_number_of_batches(data: Path) -> None:
    counts = []
    for rank in range(4):
        ds = HiddenStateDataset(data, rank=rank, world_size=4, batch_size=2)
        assert len(ds) == 6  # ceil(22 / 4)
        counts.append(len(list(DataLoader(ds, batch_size=2, collate_fn=pad_collate))))
    assert counts == [3, 3, 3, 3]


def _rank_main(rank: int, root: str, store: str, queue: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ds = HiddenStateDataset(root, shuffle=True, seed=5)
        queue.put((ds.rank, ds.world_size, [os.path.basename(s.path) for s in ds]))
    finally:
        dist.destroy_process_group()


def test_ranks_of_a_process_group_agree_on_the_split(data: Path, tmp_path: Path) -> None:
    results = run_ranks(_rank_main, lambda r: (r, str(data), str(tmp_path / "store")))
    assert [(r, w) for r, w, _ in results] == [(0, 2), (1, 2)]
    ref = HiddenStateDataset(data, shuffle=True, seed=5, rank=0, world_size=2)
    assert results[0][2] == ref.epoch_names()
    assert set(results[0][2]) | set(results[1][2]) == {f"hs_{i}.safetensors" for i in range(N)}
    assert len(results[0][2]) == len(results[1][2]) == N // 2


def test_reader_options_pass_through(hs_dir: Path) -> None:
    write_samples(hs_dir, 3, tokens=4, layers=4, hidden=8, layer_ids=[2, 9, 16, 23])
    by_position = next(iter(HiddenStateDataset(hs_dir, layers=[-1], dtype=torch.float32)))
    assert by_position.hidden_states.shape == (4, 1, 8)
    assert by_position.hidden_states.dtype == torch.float32
    assert torch.equal(by_position.hidden_states[:, 0], make_tensors(0, 4, 4, 8)[1][:, -1].float())
    by_id = next(iter(HiddenStateDataset(hs_dir, layer_ids=[23, 2])))
    assert by_id.layer_ids == [23, 2]
    assert torch.equal(by_id.hidden_states, make_tensors(0, 4, 4, 8)[1][:, [3, 0]])
    assert len(HiddenStateDataset(hs_dir, max_samples=2)) == 2
    assert len(list(HiddenStateDataset(hs_dir, max_samples=2))) == 2


def test_bad_options_fail_at_construction(data: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        HiddenStateDataset(data, colour="blue")
    with pytest.raises(ValueError, match="on_error"):
        HiddenStateDataset(data, on_error="ignore")
    with pytest.raises(ValueError, match="layers"):
        HiddenStateDataset(data, layers=[0], layer_ids=[1])
    with pytest.raises(FileNotFoundError):
        HiddenStateDataset(tmp_path / "missing")
    with pytest.raises(ValueError, match="batch_size"):
        HiddenStateDataset(data, batch_size=0)


def test_main_process_iteration_counts_for_state_dict(data: Path) -> None:
    """num_workers=0 (e.g. torchdata's StatefulDataLoader): the dataset counts itself."""
    ds = HiddenStateDataset(data, shuffle=True, seed=9)
    loader = DataLoader(ds, batch_size=3, num_workers=0, collate_fn=pad_collate)
    got = []
    for i, batch in enumerate(loader):
        got += names_in([batch])
        assert ds.state_dict()["consumed"] == 3 * (i + 1)
        if i == 2:
            state = ds.state_dict()
            break
    resumed = HiddenStateDataset(data, shuffle=True, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual per-epoch call keeps the restored position
    got += names_in(list(DataLoader(resumed, batch_size=3, collate_fn=pad_collate)))
    assert got == ds.epoch_names(0)
    assert (resumed.epoch, resumed.consumed) == (1, 0)
    next_epoch = names_in(list(DataLoader(resumed, batch_size=3, collate_fn=pad_collate)))
    assert next_epoch == ds.epoch_names(1) and resumed.epoch == 2


def test_stateful_dataloader_resumes_through_the_dataset_state(data: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = HiddenStateDataset(data, shuffle=True, seed=9)
    loader = stateful.StatefulDataLoader(ds, batch_size=3, collate_fn=pad_collate)
    got = []
    for i, batch in enumerate(loader):
        got += names_in([batch])
        if i == 2:
            state = loader.state_dict()
            break
    resumed = HiddenStateDataset(data, shuffle=True, seed=9)
    again = stateful.StatefulDataLoader(resumed, batch_size=3, collate_fn=pad_collate)
    again.load_state_dict(state)
    assert got + names_in(list(again)) == ds.epoch_names(0)
    assert names_in(list(again)) == ds.epoch_names(1)


def test_stateful_dataloader_keeps_the_resume_contract(data: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        ds = HiddenStateDataset(data, shuffle=True, seed=9)
        return stateful.StatefulDataLoader(ds, batch_size=3, collate_fn=pad_collate)

    def units(loader: Any) -> Iterator[list[str]]:
        return (names_in([batch]) for batch in loader)

    check_resume_contract(make, units, stop_after=3, through_json=False)


def test_a_dataloader_without_workers_keeps_the_resume_contract(data: Path) -> None:
    def make() -> HiddenStateDataset:
        return HiddenStateDataset(data, shuffle=True, seed=9)

    def units(ds: HiddenStateDataset) -> Iterator[list[str]]:
        loader = DataLoader(ds, batch_size=3, num_workers=0, collate_fn=pad_collate)
        return (names_in([batch]) for batch in loader)

    check_resume_contract(make, units, stop_after=2)


def test_load_state_dict_rejects_a_different_setup(data: Path) -> None:
    state = HiddenStateDataset(data, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        HiddenStateDataset(data, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        HiddenStateDataset(data, shuffle=True, seed=1, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        HiddenStateDataset(data, shuffle=True, seed=1).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="outside"):
        HiddenStateDataset(data, shuffle=True, seed=1).load_state_dict({**state, "consumed": N + 1})
    write_samples(data, 1, start=N)
    with pytest.raises(ValueError, match=r"sample count of 22.*23.*names="):
        HiddenStateDataset(data, shuffle=True, seed=1).load_state_dict(state)
    # names= pins the checkpoint's sample list, so the grown directory resumes fine.
    pinned = HiddenStateDataset(
        data, shuffle=True, seed=1, names=[f"hs_{i}.safetensors" for i in range(N)]
    )
    pinned.load_state_dict({**state, "consumed": 5})
    assert len(list(pinned)) == N - 5


def test_set_epoch(data: Path) -> None:
    ds = HiddenStateDataset(data, shuffle=True)
    ds.load_state_dict({**ds.state_dict(), "epoch": 2, "consumed": 5})
    ds.set_epoch(2)
    assert (ds.epoch, ds.consumed) == (2, 5)
    assert [os.path.basename(s.path) for s in ds] == ds.epoch_names(2)[5:]
    ds.set_epoch(3)
    assert (ds.epoch, ds.consumed) == (3, 0)
    assert [os.path.basename(s.path) for s in ds] == ds.epoch_names(3)


def test_lengths_come_from_headers(data: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = HiddenStateDataset(data, shuffle=True, seed=2, rank=1, world_size=2)
    by_name = {f"hs_{i}.safetensors": TOKENS[i] for i in range(N)}
    assert ds.lengths() == [by_name[n] for n in ds.epoch_names()]
    assert ds.lengths(epoch=1) == [by_name[n] for n in ds.epoch_names(1)]
    assert ds.stats.yielded == 0  # nothing was loaded
    fresh = HiddenStateDataset(data)
    strict = HiddenStateDataset(data, on_error="raise")
    # A sample that went bad after the list was taken: length 0 with a warning, or raise.
    (data / "hs_0.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json")
    with caplog.at_level(logging.WARNING):
        assert fresh.lengths()[0] == 0
    assert "hs_0.safetensors" in caplog.text
    with pytest.raises(Exception, match="not valid JSON"):
        strict.lengths()
    # Taken now, the list leaves it out (it is not usable), naming it.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(HiddenStateDataset(data)) == N - 1
    assert "hs_0.safetensors" in caplog.text and "1 corrupt" in caplog.text


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from samples import write_samples
print("ready", flush=True)
sys.stdin.readline()
for i in range({count}):
    write_samples({root!r}, 1, start=i, tokens=3)
print("done", flush=True)
"""


def test_follow_mode_with_claims_and_two_workers_reads_each_sample_once(hs_dir: Path) -> None:
    count = 24
    script = WRITER.format(tests=str(Path(__file__).parents[2]), count=count, root=str(hs_dir))
    writer = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "ready"
        ds = HiddenStateDataset(
            hs_dir, follow=True, idle_timeout=2.0, watch="poll", poll_interval=0.05
        )
        assert ds.claim  # automatic in follow mode
        loader = HiddenStateLoader(ds, batch_size=2, num_workers=2)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        got = names_in(list(loader))
        assert writer.stdout.readline().strip() == "done"
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert sorted(got) == sorted(f"hs_{i}.safetensors" for i in range(count))
    assert len(got) == len(set(got))
    claims = list((hs_dir / ".claims" / "default").iterdir())
    assert len(claims) == count
    assert ds.state_dict()["consumed"] == count and ds.state_dict()["mode"] == "follow"


def test_follow_mode_without_claims_refuses_several_consumers(hs_dir: Path) -> None:
    write_samples(hs_dir, 2)
    with pytest.raises(ValueError, match="claim=True"):
        HiddenStateDataset(hs_dir, follow=True, claim=False, rank=0, world_size=2)
    ds = HiddenStateDataset(hs_dir, follow=True, claim=False, idle_timeout=0.5)
    with pytest.raises(ValueError, match="claim=True"):
        HiddenStateLoader(ds, num_workers=2)
    # A plain DataLoader cannot be checked up front: the workers refuse.
    batches = iter(DataLoader(ds, num_workers=2, collate_fn=pad_collate))
    try:
        with pytest.raises(ValueError, match="claim=True"):
            next(batches)
    finally:
        # Shut the workers down now: left to the garbage collector, the DataLoader
        # iterator of a failed worker waits 5 s per worker.
        batches._shutdown_workers()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="no length"):
        len(ds)
