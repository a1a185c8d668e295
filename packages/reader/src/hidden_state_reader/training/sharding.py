"""Who reads what: rank detection and the deterministic static order of an epoch.

The order of one epoch is built in three steps, each a pure function, so every rank and
every DataLoader worker computes the same answer without talking to the others:

1. ``epoch_order``: the global order (a seeded permutation, identical in every process);
2. ``rank_slice``: this rank's share, strided like ``DistributedSampler`` (padded by
   wrapping around so all ranks get the same count and DDP never waits on a rank that
   ran out early);
3. ``worker_chunks``: this worker's share of the rank's remaining positions, as
   consecutive chunks dealt round-robin (chunk ``j`` to worker ``j % num_workers``).

Step 3 is what makes resuming exact. A DataLoader asks its workers for batches
round-robin and returns them in that order, so when the chunk size equals the batch
size, batch ``j`` is chunk ``j``: the batches arrive in exactly the rank's order,
whatever the number of workers. "How many samples the training loop has consumed"
then describes the position completely; a resumed run skips that many and deals the
rest out again, to any number of workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def _env_int(key: str) -> int | None:
    raw = os.environ.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def distributed_context(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's rank and the number of ranks.

    Each value comes from the first of these that has it: the argument,
    ``torch.distributed`` (when a process group is initialized), the ``RANK`` /
    ``WORLD_SIZE`` environment variables set by ``torchrun`` and most launchers, or the
    single-process default ``(0, 1)``.

    Args:
        rank: Explicit rank (wins over detection).
        world_size: Explicit number of ranks (wins over detection).

    Returns:
        ``(rank, world_size)``.

    Raises:
        ValueError: The values are not integers, ``world_size < 1`` or the rank is not
            in ``[0, world_size)``.
    """
    detected_rank: int | None = None
    detected_world: int | None = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        detected_rank = torch.distributed.get_rank()
        detected_world = torch.distributed.get_world_size()
    else:
        detected_rank = _env_int("RANK")
        detected_world = _env_int("WORLD_SIZE")
    world = world_size if world_size is not None else detected_world
    if world is None:
        world = 1
    r = rank if rank is not None else detected_rank
    if r is None:
        r = 0
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world!r}")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
        raise ValueError(f"rank must be an integer in [0, {world}), got {r!r}")
    return r, world


def epoch_order(names: Sequence[T], *, seed: int, epoch: int, shuffle: bool) -> list[T]:
    """The global order of one epoch, the same in every process.

    Args:
        names: The items in their canonical order (sample names, naturally sorted).
        seed: Base seed shared by all ranks.
        epoch: The epoch; each epoch gets its own permutation.
        shuffle: Permute with a ``torch.Generator`` seeded with ``seed + epoch``;
            without it the canonical order is kept.

    Returns:
        A new list.
    """
    if not shuffle or len(names) < 2:
        return list(names)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    permutation = torch.randperm(len(names), generator=generator).tolist()
    return [names[i] for i in permutation]


def rank_share(total: int, rank: int, world: int, *, even: bool = True) -> int:
    """How many items ``rank_slice`` gives ``rank`` out of ``total``."""
    if even:
        return math.ceil(total / world) if total else 0
    return len(range(rank, total, world))


def rank_slice(order: Sequence[T], rank: int, world: int, *, even: bool = True) -> list[T]:
    """This rank's share of an epoch's order, strided as ``DistributedSampler`` does.

    Args:
        order: The global order of the epoch.
        rank: This rank, in ``[0, world)``.
        world: Number of ranks.
        even: Give every rank exactly ``ceil(len(order) / world)`` items by wrapping
            around to the start of ``order`` (a few samples are seen twice per epoch,
            as with ``DistributedSampler(drop_last=False)``). Needed for DDP, where a
            rank that runs out of batches early leaves the others hanging in a
            collective. With ``even=False`` the split is a plain partition: every item
            exactly once, shares differing by at most one.

    Returns:
        The items of ``rank``, in order.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    items = list(order)
    if even and items:
        total = math.ceil(len(items) / world) * world
        padding = total - len(items)
        while padding > 0:  # more than one lap when there are fewer items than ranks
            take = items[:padding]
            items.extend(take)
            padding -= len(take)
    return items[rank::world]


def worker_chunks(positions: Sequence[T], worker_id: int, num_workers: int, chunk: int) -> list[T]:
    """This worker's share: consecutive chunks of ``chunk`` items, dealt round-robin.

    Chunk ``j`` (items ``j*chunk`` to ``(j+1)*chunk - 1``) goes to worker
    ``j % num_workers``. With a DataLoader whose ``batch_size`` equals ``chunk`` and
    ``in_order=True`` (the default), batch ``j`` is then chunk ``j``.

    Args:
        positions: The items still to be read on this rank, in order.
        worker_id: This worker, in ``[0, num_workers)``.
        num_workers: Number of workers (1 in the main process).
        chunk: Items per chunk (the batch size).

    Returns:
        The worker's items, in order.
    """
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id must be in [0, {num_workers}), got {worker_id}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if num_workers == 1:
        return list(positions)
    mine: list[T] = []
    stride = chunk * num_workers
    for start in range(worker_id * chunk, len(positions), stride):
        mine.extend(positions[start : start + chunk])
    return mine
