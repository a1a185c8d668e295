"""Prefix caching with forward capture: which full prefix blocks' rows are held (scheduler side).

vLLM serves a prompt's cached prefix without computing it, so its rows come from the
step that first computed those tokens. Rows are a function of the token prefix, which
vLLM's block hashes name (each chains every earlier token), so the rows of a full block
are kept under its hash: the worker holds them in the arena (``RowArena.pin``), this
index decides which. A request is admitted with a cache hit only when every hit block's
rows are held, or will be by the end of the step that computes them (a request filling
them is running: vLLM caches a block in the step that computes it, so a request may hit
it in that same step). Otherwise the request is told to skip the prefix cache
(``request.skip_reading_prefix_cache``) and is scheduled a step later, computing every
token: a sample is never short of rows. The index is bounded (``prefix_rows_bytes``),
least recently used first out; the worker lets go of what is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hidden_state_connector.engine.forward.arena import RowArena, RowCopies
from hidden_state_connector.engine.forward.routing import FlatRoute
from hidden_state_connector.engine.metadata import StepRows

MISSING = -1
"""The entry id of a hit block whose rows are not held (its sample fails, with why)."""


@dataclass
class _Entry:
    id: int
    filled: bool = False
    owner: str | None = None  # the running request that will compute it (until filled)


@dataclass
class PrefixCounters:
    """What prefix caching did, for the stats and the docs' measurements."""

    hit_tokens: int = 0
    admitted: int = 0
    recomputed: int = 0
    held_blocks: int = 0


@dataclass
class PrefixRowIndex:
    """The held prefix rows, by vLLM block hash, and the requests that may use them.

    Args:
        block_tokens: Tokens per hashed block (vLLM's ``block_size``).
        max_blocks: Held blocks at most (``prefix_rows_bytes`` over a block's rows).
    """

    block_tokens: int
    max_blocks: int
    counters: PrefixCounters = field(default_factory=PrefixCounters)
    _entries: OrderedDict[Any, _Entry] = field(default_factory=OrderedDict)
    _requests: dict[str, Any] = field(default_factory=dict)  # vLLM's Request objects
    _promised: dict[str, list[Any]] = field(default_factory=dict)
    _released: list[int] = field(default_factory=list)
    _next_id: int = 0

    def admits(self, request: Any, hit_tokens: int) -> bool:
        """Whether ``request`` may use its prefix-cache hit of ``hit_tokens`` tokens."""
        self._requests[request.request_id] = request
        if hit_tokens <= 0:
            self._promise_prompt(request, 0)
            return True
        blocks, partial = divmod(hit_tokens, self.block_tokens)
        hashes = list(request.block_hashes[:blocks])
        ok = not partial and len(hashes) == blocks and blocks <= self.max_blocks
        ok = ok and all(self._usable(self._entries.get(h)) for h in hashes)
        if ok:
            for h in hashes:
                self._entries.move_to_end(h)
            self.counters.admitted += 1
            self.counters.hit_tokens += hit_tokens
            self._promise_prompt(request, hit_tokens)
        else:
            self.counters.recomputed += 1
        return ok

    def _promise_prompt(self, request: Any, computed: int) -> None:
        """Promise a request's prompt blocks when it is let in.

        A request vLLM lets in later in the same scheduling pass may hit the blocks this
        one computes in this step (GRPO's samples of one prompt).
        """
        prompt_tokens = len(request.prompt_token_ids or ())
        self._promise(request.request_id, request.block_hashes, computed, prompt_tokens)

    def _usable(self, entry: _Entry | None) -> bool:
        return entry is not None and (entry.filled or entry.owner in self._requests)

    def step(
        self, req_id: str, computed_before: int, scheduled: int, first: bool
    ) -> tuple[list[int] | None, list[tuple[int, int]] | None]:
        """A captured request's step: the held rows it starts from and the blocks it fills.

        Returns:
            ``StepRows.cached_rows`` (first step of a request with a hit) and
            ``StepRows.filled_rows``.
        """
        request = self._requests.get(req_id)
        if request is None:
            return None, None
        hashes = request.block_hashes
        bt = self.block_tokens
        cached = None
        if first and computed_before > 0:
            cached = [self._id_of(h) for h in hashes[: -(-computed_before // bt)]]
        if first:
            self._promise(req_id, hashes, computed_before, len(request.prompt_token_ids or ()))
        filled = []
        end = computed_before + scheduled
        for j in range(computed_before // bt, min(end // bt, len(hashes))):
            entry = self._entries.get(hashes[j])
            if entry is None:
                entry = self._entries[hashes[j]] = self._new_entry()
            elif entry.filled:
                continue
            entry.filled, entry.owner = True, None
            self._entries.move_to_end(hashes[j])
            filled.append((j, entry.id))
        return cached, filled or None

    def _id_of(self, block_hash: Any) -> int:
        entry = self._entries.get(block_hash)
        return MISSING if entry is None else entry.id

    def _promise(self, req_id: str, hashes: Any, computed: int, prompt_tokens: int) -> None:
        """Prompt blocks this request will compute: a request may hit them meanwhile."""
        mine = self._promised.setdefault(req_id, [])
        bt = self.block_tokens
        for j in range(computed // bt, min(prompt_tokens // bt, len(hashes))):
            if hashes[j] not in self._entries:
                self._entries[hashes[j]] = self._new_entry(owner=req_id)
                mine.append(hashes[j])

    def _new_entry(self, owner: str | None = None) -> _Entry:
        self._next_id += 1
        return _Entry(self._next_id, owner=owner)

    def forget(self, req_id: str) -> None:
        """A request ended: the blocks it promised and never computed are not held."""
        self._requests.pop(req_id, None)
        for h in self._promised.pop(req_id, ()):
            entry = self._entries.get(h)
            if entry is not None and not entry.filled and entry.owner == req_id:
                del self._entries[h]

    def take_released(self) -> list[int]:
        """Drop the least recently used over the bound; the ids the worker lets go of."""
        while len(self._entries) > self.max_blocks:
            _, entry = self._entries.popitem(last=False)
            if entry.filled:
                self._released.append(entry.id)
        released, self._released = self._released, []
        self.counters.held_blocks = sum(e.filled for e in self._entries.values())
        return released


class HeldPrefixRows:
    """The worker's half: held prefix blocks' arena blocks, by ``PrefixRowIndex`` entry id.

    Args:
        arena: The host arena the rows live in.
        block_tokens: Tokens per hashed block (a multiple of the arena's block size).
    """

    def __init__(self, arena: RowArena, block_tokens: int) -> None:
        self.arena = arena
        self.block_tokens = block_tokens
        self._held: dict[int, list[int]] = {}

    def write_step(
        self,
        steps: Sequence[StepRows],
        entries: Sequence[tuple[str, int, int] | None],
        route: FlatRoute,
        rows: torch.Tensor,
        deferred: RowCopies | None = None,
    ) -> dict[int, str]:
        """Store a step's rows (``RowArena.write_step``), with the held prefixes they use.

        Requests that start from held rows are placed after the others, earliest first:
        a block a request fills in this step may be used by another one in the same step.

        Returns:
            Why an entry's sample cannot be complete, by entry index.
        """
        failures: dict[int, str] = {}
        order = sorted(
            range(len(steps)),
            key=lambda i: (steps[i].cached_rows is not None, steps[i].computed_before),
        )
        stored = list(entries)
        for i in order:
            failure = self._adopt(steps[i]) if steps[i].cached_rows is not None else None
            entry = entries[i]
            if failure is None and entry is not None:
                failure = self.arena.reserve(*entry)
            if failure is not None:
                failures[i] = failure
                stored[i] = None
            if steps[i].filled_rows:
                self._hold(steps[i])
        self.arena.scatter(
            stored, route.rows, route.owner, route.positions, rows, deferred=deferred
        )
        return failures

    def _adopt(self, step: StepRows) -> str | None:
        """Point a request's served prefix at the held rows; why not (None: done)."""
        assert step.cached_rows is not None
        bt = self.block_tokens
        if step.computed_before % bt:
            partial = step.computed_before % bt
            return f"a partial block of {partial} tokens was served from the prefix cache"
        first = self.arena.filled(step.req_id) // bt
        blocks: list[int] = []
        for j in range(first, len(step.cached_rows)):
            held = self._held.get(step.cached_rows[j])
            if held is None:
                return (
                    f"rows of tokens [{j * bt}, {(j + 1) * bt}) were served from vLLM's prefix "
                    "cache but are not held (see prefix_rows_bytes)"
                )
            blocks.extend(held)
        if blocks:
            self.arena.adopt(step.req_id, first * bt, blocks)
        return None

    def _hold(self, step: StepRows) -> None:
        bt = self.block_tokens
        for j, entry_id in step.filled_rows or ():
            if entry_id not in self._held:
                held = self.arena.pin(step.req_id, j * bt, (j + 1) * bt)
                if held is not None:
                    self._held[entry_id] = held

    def release(self, entry_ids: Sequence[int]) -> None:
        """Let go of prefix rows the scheduler half dropped."""
        for entry_id in entry_ids:
            held = self._held.pop(entry_id, None)
            if held is not None:
                self.arena.unpin(held)

    @property
    def held_blocks(self) -> int:
        """Prefix blocks held now."""
        return len(self._held)
