"""Prefix caching's held rows, without vLLM: the scheduler's index and the arena's sharing.

``PrefixRowIndex`` is fed stand-ins of vLLM's requests (an id, block hashes, a prompt);
``HeldPrefixRows`` and ``RowArena`` run on real host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hidden_state_connector.engine.forward.arena import RowArena
from hidden_state_connector.engine.forward.prefix_rows import (
    MISSING,
    HeldPrefixRows,
    PrefixRowIndex,
)
from hidden_state_connector.engine.forward.routing import FlatRoute
from hidden_state_connector.engine.metadata import StepRows


@dataclass
class Request:
    """What the index reads of vLLM's ``Request``."""

    request_id: str
    block_hashes: list[bytes]
    prompt_token_ids: list[int] = field(default_factory=list)


def _request(req_id: str, hashes: str, prompt_tokens: int) -> Request:
    return Request(req_id, [h.encode() for h in hashes], [1] * prompt_tokens)


def test_a_hit_is_admitted_only_on_rows_held_or_being_computed() -> None:
    index = PrefixRowIndex(block_tokens=4, max_blocks=10)
    first = _request("a", "xyz", 12)
    assert index.admits(first, 0)
    assert index.step("a", 0, 6, True) == (None, [(0, 1)])  # promises blocks 1, 2 too
    # A request hitting blocks "a" has not computed yet: a is running, so it will.
    second = _request("b", "xyz", 12)
    assert index.admits(second, 8)
    cached, filled = index.step("b", 8, 4, True)
    assert cached == [1, 2] and filled == [(2, 3)]
    assert index.step("a", 6, 6, False) == (None, [(1, 2)])  # b filled block 2 first
    # Not a whole block, or a block nobody holds: the hit is refused.
    assert not index.admits(_request("c", "xyz", 12), 6)
    assert not index.admits(_request("d", "xq", 12), 8)
    assert index.counters.admitted == 1 and index.counters.recomputed == 2


def test_an_ended_request_leaves_no_promise_and_the_bound_drops_the_oldest() -> None:
    index = PrefixRowIndex(block_tokens=4, max_blocks=2)
    index.admits(_request("a", "pqrs", 16), 0)
    index.step("a", 0, 4, True)  # fills p, promises q r s
    index.forget("a")  # ended before computing q r s
    assert not index.admits(_request("b", "pq", 8), 8)
    assert index.take_released() == []  # only p is left, within the bound
    index.admits(_request("c", "uvw", 12), 0)
    index.step("c", 0, 12, True)
    assert index.take_released() == [1, 5]  # p and u, the least recently used, go
    assert index.counters.held_blocks == 2


def _route(owner: list[int], positions: list[int]) -> FlatRoute:
    rows = torch.arange(len(owner))
    return FlatRoute(rows, torch.tensor(owner), torch.tensor(positions), {})


def test_a_request_starts_from_held_rows_filled_in_the_same_step() -> None:
    arena = RowArena(1 << 16, 4, 1, 2, torch.float32)
    held = HeldPrefixRows(arena, block_tokens=4)
    rows = torch.randn(10, 1, 2)
    # "a" computes positions 0-7 and fills blocks 0, 1; "b" (listed first) starts from
    # them and computes 8-9 in the same step.
    steps = [
        StepRows("b", 8, 2, [], 0, cached_rows=[11, 12]),
        StepRows("a", 0, 8, [], 0, filled_rows=[(0, 11), (1, 12)]),
    ]
    entries = [("b", 8, 10), ("a", 0, 8)]
    route = _route([1] * 8 + [0, 0], list(range(10)))
    assert held.write_step(steps, entries, route, rows) == {}
    b = arena.data[arena.blocks("b")].reshape(-1, 1, 2)[:10]
    assert torch.equal(b, rows[:10])
    assert arena.blocks("b")[:2] == arena.blocks("a")  # shared, not copied
    free = arena.free_blocks
    arena.release("a")
    arena.release("b")
    assert arena.free_blocks == free + 1  # b's own block; the held two stay
    held.release([11, 12])
    assert arena.free_blocks == arena.num_blocks


def test_rows_not_held_fail_the_sample_with_the_reason() -> None:
    arena = RowArena(1 << 16, 4, 1, 2, torch.float32)
    held = HeldPrefixRows(arena, block_tokens=4)
    steps = [StepRows("b", 4, 1, [], 0, cached_rows=[MISSING])]
    failures = held.write_step(steps, [("b", 4, 5)], _route([0], [4]), torch.randn(1, 1, 2))
    assert "rows of tokens [0, 4) were served from vLLM's prefix cache" in failures[0]
    assert arena.filled("b") == 0
