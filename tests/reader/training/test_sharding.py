"""Rank detection and the deterministic static order (hidden_state_reader.training.sharding)."""

from __future__ import annotations

import json
import math
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from hidden_state_reader.training.sharding import (
    distributed_context,
    epoch_order,
    rank_share,
    rank_slice,
    worker_chunks,
)

from procs import run_ranks

NAMES = [f"hs_{i}.safetensors" for i in range(50)]


# -- distributed_context ----------------------------------------------------------------


def test_context_defaults_to_single_process() -> None:
    assert distributed_context() == (0, 1)


def test_context_reads_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed_context() == (2, 4)
    # Explicit arguments win, each on its own.
    assert distributed_context(rank=1, world_size=3) == (1, 3)
    assert distributed_context(rank=3) == (3, 4)
    assert distributed_context(world_size=8) == (2, 8)


def test_context_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="rank must be"):
        distributed_context(rank=4, world_size=4)
    with pytest.raises(ValueError, match="rank must be"):
        distributed_context(rank=-1, world_size=2)
    with pytest.raises(ValueError, match="world_size must be"):
        distributed_context(rank=0, world_size=0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        distributed_context()


def _rank_in_process_group(rank: int, store: str, queue: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        queue.put((rank, distributed_context()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_context_prefers_initialized_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stale launcher environment must lose against the real process group.
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    results = run_ranks(_rank_in_process_group, lambda r: (r, str(tmp_path / "store")))
    assert results == [(0, (0, 2)), (1, (1, 2))]


# -- epoch_order ------------------------------------------------------------------------


def test_epoch_order_is_a_seeded_permutation() -> None:
    first = epoch_order(NAMES, seed=7, epoch=0, shuffle=True)
    torch.manual_seed(123)  # the global RNG must not matter
    assert epoch_order(NAMES, seed=7, epoch=0, shuffle=True) == first
    assert sorted(first) == sorted(NAMES)
    assert first != NAMES
    assert epoch_order(NAMES, seed=7, epoch=1, shuffle=True) != first
    assert epoch_order(NAMES, seed=8, epoch=0, shuffle=True) != first
    assert epoch_order(NAMES, seed=7, epoch=3, shuffle=False) == NAMES


def test_epoch_order_is_the_same_in_another_process() -> None:
    code = (
        "import json; from hidden_state_reader.training.sharding import epoch_order;"
        f"print(json.dumps(epoch_order({NAMES!r}, seed=11, epoch=4, shuffle=True)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert json.loads(out) == epoch_order(NAMES, seed=11, epoch=4, shuffle=True)


# -- rank_slice ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("total", [0, 1, 5, 12, 13])
def test_plain_split_covers_everything_exactly_once(world: int, total: int) -> None:
    order = NAMES[:total]
    shares = [rank_slice(order, r, world, even=False) for r in range(world)]
    assert sorted(n for share in shares for n in share) == sorted(order)
    assert max(map(len, shares)) - min(map(len, shares)) <= (1 if total else 0)
    assert [len(s) for s in shares] == [
        rank_share(total, r, world, even=False) for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("total", [1, 5, 12, 13])
def test_even_split_pads_every_rank_to_the_same_length(world: int, total: int) -> None:
    order = NAMES[:total]
    shares = [rank_slice(order, r, world, even=True) for r in range(world)]
    per_rank = math.ceil(total / world)
    assert [len(s) for s in shares] == [per_rank] * world
    assert all(rank_share(total, r, world) == per_rank for r in range(world))
    everything = [n for share in shares for n in share]
    assert set(everything) == set(order)
    # The padding repeats the start of the order, like DistributedSampler.
    extra = per_rank * world - total
    repeated = sorted(everything)
    for n in set(order):
        repeated.remove(n)
    padding = (order * (world + 1))[:extra] if extra else []
    assert sorted(repeated) == sorted(padding)


@pytest.mark.parametrize(("total", "world"), [(10, 3), (12, 4), (5, 2), (2, 5)])
def test_even_split_matches_distributed_sampler(total: int, world: int) -> None:
    for rank in range(world):
        sampler = DistributedSampler(range(total), num_replicas=world, rank=rank, shuffle=False)
        assert rank_slice(list(range(total)), rank, world, even=True) == list(sampler)


def test_empty_order_gives_empty_shares() -> None:
    assert rank_slice([], 0, 4) == []
    assert rank_share(0, 0, 4) == 0


# -- worker_chunks ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_worker_chunks_round_robin_rebuilds_the_order(workers: int, chunk: int) -> None:
    positions = list(range(23))
    shares = [worker_chunks(positions, w, workers, chunk) for w in range(workers)]
    # What a DataLoader does: batch j comes from worker j % workers.
    batches_of = [[s[i : i + chunk] for i in range(0, len(s), chunk)] for s in shares]
    merged = []
    for j in range(math.ceil(len(positions) / chunk)):
        merged.extend(batches_of[j % workers][j // workers])
    assert merged == positions
    assert worker_chunks(positions, 0, 2, 3)[:6] == [0, 1, 2, 6, 7, 8]


def test_worker_chunks_validates() -> None:
    with pytest.raises(ValueError, match="worker_id"):
        worker_chunks([1, 2], 2, 2, 1)
    with pytest.raises(ValueError, match="chunk"):
        worker_chunks([1, 2], 0, 2, 0)
