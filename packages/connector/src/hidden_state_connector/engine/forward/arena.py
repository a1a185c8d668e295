"""Host rows of captured requests, in blocks, until the write pipeline copies them out.

The arena is a ``[blocks, block_size, layers, hidden]`` host tensor: the same view the
extract engine's hidden-state cache gives the ``Extractor``, so the write pipeline copies
chunks out of it unchanged. Blocks are handed to requests as their rows arrive and taken
back once their sample's copies are done. It is reserved as address space
(``capture_buffer_bytes``); the operating system commits pages as rows are written.
Rows are stored by position, so rows recomputed after a preemption overwrite the same
positions with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
            self.data = torch.empty(num_blocks, block_size, num_layers, hidden_size, dtype=dtype)
        self._flat = self.data.view(num_blocks * block_size, num_layers, hidden_size)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[str, list[int]] = {}
        self._filled: dict[str, int] = {}  # rows [0, filled) of each request are stored
        self._full_message = f"capture_buffer_bytes holds {num_blocks} blocks, all in use"

    @property
    def num_blocks(self) -> int:
        """Blocks in the arena."""
        return int(self.data.shape[0])

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
    ) -> dict[int, str]:
        """Store a step's rows of several requests in one scatter.

        Args:
            entries: ``(req_id, start, stop)`` per step entry (the positions its rows
                cover), or None for an entry whose rows are not to be stored.
            row_index: Each row's index into ``rows``' token axis.
            owner: Each row's entry index.
            positions: Each row's token position.
            rows: The step's host rows, ``[layers, tokens, hidden]``.

        Returns:
            Why an entry's sample cannot be complete, by entry index (no free block; or a
            gap before these positions: its earlier rows were never stored).
        """
        bs = self.block_size
        failures: dict[int, str] = {}
        spanned: list[int] = []
        base = [0] * len(entries)  # spanned index of each entry's first block, less it
        stored = [False] * len(entries)
        for index, entry in enumerate(entries):
            if entry is None:
                continue
            req_id, start, stop = entry
            have = self._blocks.setdefault(req_id, [])
            need = -(-stop // bs) - len(have)
            if need > len(self._free):
                failures[index] = self._full_message
                continue
            for _ in range(need):
                have.append(self._free.pop())
            filled = self._filled.get(req_id, 0)
            if start > filled:
                failures[index] = (
                    f"rows of tokens [{filled}, {start}) were never computed in a captured step"
                )
            else:
                self._filled[req_id] = max(filled, stop)
            base[index] = len(spanned) - start // bs
            spanned.extend(have[start // bs : -(-stop // bs)])
            stored[index] = True
        if spanned:
            keep = torch.tensor(stored)[owner]
            owner, pos = owner[keep], positions[keep].to(torch.int64)
            block = torch.tensor(spanned, dtype=torch.int64)[torch.tensor(base)[owner] + pos // bs]
            with torch.inference_mode():
                self._flat[block * bs + pos % bs] = rows[:, row_index[keep]].transpose(0, 1)
        return failures

    def release(self, req_id: str) -> None:
        """Give a request's blocks back (its copies are done, or it failed)."""
        self._free.extend(reversed(self._blocks.pop(req_id, [])))
        self._filled.pop(req_id, None)
