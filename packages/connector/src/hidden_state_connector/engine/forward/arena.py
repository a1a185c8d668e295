"""Host rows of captured requests, in blocks, until the write pipeline copies them out.

The arena is a ``[blocks, block_size, layers, hidden]`` host tensor: the same view the
extract engine's hidden-state cache gives the ``Extractor``, so the write pipeline copies
chunks out of it unchanged. Blocks are handed to requests as their rows arrive and taken
back once their sample's copies are done. It is reserved as address space
(``capture_buffer_bytes``); the operating system commits pages as rows are written.
Rows are stored by position, so rows recomputed after a preemption overwrite the same
positions with the same values. A step that computes positions ``[start, stop)`` again
(the rows of rejected draft tokens are recomputed from the first rejected position on;
a preempted request restarts) makes ``stop`` the request's frontier: rows past it are
stale, never counted as filled, and their blocks go back. With prefix caching, blocks
are shared: a held prefix block (``pin``) and every request that starts from it
(``adopt``) count as users, and a block goes back to the free list when its last user
lets go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hidden_state_reader.kernels import host_memory

ARENA_BLOCK_TOKENS = 16
"""Tokens per arena block (independent of the KV cache's block size)."""

RowCopies = list[Callable[[], None]]
"""Copies of rows into reserved blocks, run later (``deferred``): outside a caller's lock."""


class RowArena:
    """Block-allocated host rows, per request.

    Args:
        capacity_bytes: Host memory the arena may hold (``capture_buffer_bytes``).
        block_size: Tokens per arena block.
        num_layers: Captured layers.
        hidden_size: Width of a row.
        dtype: The model's activation dtype.
    """

    def __init__(
        self,
        capacity_bytes: int,
        block_size: int,
        num_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        block_bytes = block_size * num_layers * hidden_size * dtype.itemsize
        num_blocks = max(1, capacity_bytes // block_bytes)
        with torch.inference_mode():
            # From the host-memory home: huge-page-advised, as every large host buffer.
            shape = (num_blocks, block_size, num_layers, hidden_size)
            self.data = host_memory.empty(shape, dtype)
        self._flat = self.data.view(num_blocks * block_size, num_layers, hidden_size)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._users = [0] * num_blocks  # requests and held prefixes using each block
        self._blocks: dict[str, list[int]] = {}
        self._filled: dict[str, int] = {}  # rows [0, filled) of each request are stored
        self._full_message = f"capture_buffer_bytes holds {num_blocks} blocks, all in use"

    @property
    def num_blocks(self) -> int:
        """Blocks in the arena."""
        return int(self.data.shape[0])

    @property
    def free_blocks(self) -> int:
        """Blocks no request and no held prefix uses."""
        return len(self._free)

    def blocks(self, req_id: str) -> list[int]:
        """A request's arena blocks, in position order."""
        return list(self._blocks.get(req_id, ()))

    def filled(self, req_id: str) -> int:
        """How many leading positions of a request hold rows."""
        return self._filled.get(req_id, 0)

    def write_step(
        self,
        entries: Sequence[tuple[str, int, int] | None],
        row_index: torch.Tensor,
        owner: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        columns: slice | None = None,
        deferred: RowCopies | None = None,
    ) -> dict[int, str]:
        """Store a step's rows of several requests in one scatter (``reserve``, ``scatter``).

        Args:
            entries: ``(req_id, start, stop)`` per step entry (the positions its rows
                cover), or None for an entry whose rows are not to be stored.
            row_index: Each row's index into ``rows``' token axis.
            owner: Each row's entry index.
            positions: Each row's token position.
            rows: The step's host rows, ``[tokens, layers, hidden]``.
            columns: The layer-axis columns ``rows`` fill (None: all; a pipeline stage's
                rows fill its layers' columns).
            deferred: Where to put the copy instead of running it (``scatter``).

        Returns:
            Why an entry's sample cannot be complete, by entry index (no free block; or a
            gap before these positions: its earlier rows were never stored).
        """
        failures = {}
        for index, entry in enumerate(entries):
            failure = None if entry is None else self.reserve(*entry)
            if failure is not None:
                failures[index] = failure
        # Rows after a gap are stored all the same (the sample fails); no block, no rows.
        full = self._full_message
        stored = [None if failures.get(i) == full else e for i, e in enumerate(entries)]
        self.scatter(stored, row_index, owner, positions, rows, columns, deferred)
        return failures

    def reserve(self, req_id: str, start: int, stop: int) -> str | None:
        """Blocks for a request's positions ``[start, stop)``; why not (None: done)."""
        bs = self.block_size
        have = self._blocks.setdefault(req_id, [])
        need = -(-stop // bs) - len(have)
        if need > len(self._free):
            return self._full_message
        for _ in range(need):
            block = self._free.pop()
            self._users[block] = 1
            have.append(block)
        filled = self._filled.get(req_id, 0)
        if start > filled:
            return f"rows of tokens [{filled}, {start}) were never computed in a captured step"
        # Rows from ``start`` on are (re)computed now: rows past ``stop`` are stale (a
        # rejected draft's, or from before a preemption), never counted; their blocks go.
        self._filled[req_id] = stop
        span = -(-stop // bs)
        for block in have[span:]:
            self._drop_user(block)
        del have[span:]
        return None

    def scatter(
        self,
        entries: Sequence[tuple[str, int, int] | None],
        row_index: torch.Tensor,
        owner: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        columns: slice | None = None,
        deferred: RowCopies | None = None,
    ) -> None:
        """Copy the rows of reserved entries (None: skipped) to their blocks, in one scatter.

        ``columns``: the layer-axis columns ``rows`` fill (None: all). ``deferred``: the
        copy is appended there instead of run: the blocks are placed now (the caller's
        lock held), the bytes move later without it, before anything reads those blocks.
        """
        bs = self.block_size
        spanned: list[int] = []
        base = [0] * len(entries)  # spanned index of each entry's first block, less it
        for index, entry in enumerate(entries):
            if entry is not None:
                req_id, start, stop = entry
                base[index] = len(spanned) - start // bs
                spanned.extend(self._blocks[req_id][start // bs : -(-stop // bs)])
        if not spanned:
            return
        keep = torch.tensor([e is not None for e in entries])[owner]
        owner, pos = owner[keep], positions[keep].to(torch.int64)
        block = torch.tensor(spanned, dtype=torch.int64)[torch.tensor(base)[owner] + pos // bs]
        target = self._flat if columns is None else self._flat[:, columns]
        dest, picked = block * bs + pos % bs, row_index[keep]

        def copy() -> None:
            with torch.inference_mode():
                target.index_copy_(0, dest, _rows_at(rows, picked))

        if deferred is None:
            copy()
        else:
            deferred.append(copy)

    def pin(self, req_id: str, start: int, stop: int) -> list[int] | None:
        """Hold a request's blocks of positions ``[start, stop)`` (block-aligned) for later.

        Returns:
            The held blocks; None when the request's rows do not reach ``stop``.
        """
        have = self._blocks.get(req_id, [])
        first, last = start // self.block_size, -(-stop // self.block_size)
        if last > len(have) or self._filled.get(req_id, 0) < stop:
            return None
        held = have[first:last]
        for block in held:
            self._users[block] += 1
        return held

    def unpin(self, blocks: Sequence[int]) -> None:
        """Let go of held blocks (``pin``); each is freed when nothing else uses it."""
        for block in blocks:
            self._drop_user(block)

    def adopt(self, req_id: str, start: int, blocks: Sequence[int]) -> None:
        """A request's positions from ``start`` (block-aligned) are held blocks' rows.

        Its own blocks from ``start`` on are let go of; its rows now reach the end of them.
        """
        have = self._blocks.setdefault(req_id, [])
        first = start // self.block_size
        for block in have[first:]:
            self._drop_user(block)
        del have[first:]
        for block in blocks:
            self._users[block] += 1
            have.append(block)
        self._filled[req_id] = len(have) * self.block_size

    def _drop_user(self, block: int) -> None:
        self._users[block] -= 1
        if self._users[block] == 0:
            self._free.append(block)

    def release(self, req_id: str) -> None:
        """Give a request's blocks back (its copies are done, or it failed)."""
        for block in reversed(self._blocks.pop(req_id, [])):
            self._drop_user(block)
        self._filled.pop(req_id, None)


def _rows_at(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]``, as a view when ``index`` is one ascending run of rows.

    That is the usual step (every row captured, less the padding at its end): its rows
    then reach the arena in one pass, without a gathered copy in between.
    """
    count = int(index.numel())
    if count:
        first, last = int(index[0]), int(index[-1])
        if last - first + 1 == count and (count == 1 or bool((index[1:] > index[:-1]).all())):
            return rows[first : last + 1]
    return rows.index_select(0, index)
