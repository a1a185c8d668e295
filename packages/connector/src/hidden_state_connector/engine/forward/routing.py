"""Which row of a step's batch belongs to which captured request, at which position.

The runner may order requests in the batch as it likes (and pads it for CUDA graphs), so
the order is not assumed. Each row's KV slot (the forward context's slot mapping, which
the attention layers write through) names a block; a block belongs to exactly one
running request (prefix caching, which shares blocks, is refused), and its index in that
request's block table gives the row's position. The scheduler half sends each captured
request's table and this step's token range (``StepRows``); rows that do not add up to
the scheduled count fail that request's sample instead of storing wrong rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_connector.engine.metadata import StepRows


def rows_of_step(step: Any) -> StepRows:
    """The ``StepRows`` of a ``compat.ScheduledRequest`` (scheduler side).

    The block ids are copied: the worker may read a step after the scheduler has added
    later blocks to its own lists (the ingest thread runs behind; the scheduler and the
    worker share objects in one process).
    """
    blocks = None if step.new_block_ids is None else list(step.new_block_ids)
    return StepRows(step.req_id, step.computed_before, step.scheduled, blocks, step.replaces_table)


@dataclass
class Routed:
    """One request's rows in this step.

    Attributes:
        rows: Row indices into the step's batch.
        positions: The token position of each row.
        failure: Why this step's rows cannot be trusted (None: they can).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    failure: str | None = None


class RowRouter:
    """Keeps captured requests' KV block tables and routes each step's rows.

    Args:
        block_size: Tokens per block of the attention group the slot mapping indexes.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def update(self, steps: Sequence[StepRows]) -> None:
        """Apply this step's block table changes."""
        for step in steps:
            if step.new_block_ids is None:
                continue
            if step.replaces_table or step.req_id not in self._tables:
                self._tables[step.req_id] = list(step.new_block_ids)
            else:
                self._tables[step.req_id].extend(step.new_block_ids)

    def forget(self, req_id: str) -> None:
        """Drop a finished request's table."""
        self._tables.pop(req_id, None)

    def route(self, slots: torch.Tensor, steps: Sequence[StepRows]) -> dict[str, Routed]:
        """Rows and positions of each step entry (``slots``: the batch's slot mapping)."""
        bs = self.block_size
        keys: list[int] = []
        owner: list[int] = []
        first_pos: list[int] = []
        failures: dict[int, str] = {}
        for index, step in enumerate(steps):
            table = self._tables.get(step.req_id, [])
            lo = step.computed_before // bs
            hi = (step.computed_before + step.scheduled - 1) // bs
            if step.scheduled > 0 and hi >= len(table):
                failures[index] = f"block table of {len(table)} blocks lacks block {hi}"
                continue
            for i in range(lo, hi + 1):
                keys.append(table[i])
                owner.append(index)
                first_pos.append(i * bs)
        found, outside = self._lookup(slots.to(torch.int64), keys, owner, first_pos, steps)
        out = {}
        for index, step in enumerate(steps):
            rows, positions = found.get(index, (_EMPTY, _EMPTY))
            failure = failures.get(index)
            stop = step.computed_before + step.scheduled
            if failure is None and (rows.numel() != step.scheduled or index in outside):
                failure = (
                    f"{rows.numel()} rows of the batch map to tokens [{step.computed_before}, "
                    f"{stop}) of this request, expected {step.scheduled}"
                )
            out[step.req_id] = Routed(rows, positions, failure)
        return out

    def _lookup(
        self,
        slots: torch.Tensor,
        keys: list[int],
        owner: list[int],
        first_pos: list[int],
        steps: Sequence[StepRows],
    ) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], set[int]]:
        """Rows of ``slots`` whose block is one of ``keys``, grouped by owner index.

        Also the owners with a row outside the tokens their step computes. Vectorised: one
        pass over the batch, whatever the number of requests.
        """
        if not keys or slots.numel() == 0:
            return {}, set()
        device = slots.device
        key_t = torch.tensor(keys, dtype=torch.int64, device=device)
        order = torch.argsort(key_t)
        sorted_keys = key_t[order]
        owner_t = torch.tensor(owner, dtype=torch.int64, device=device)[order]
        first_t = torch.tensor(first_pos, dtype=torch.int64, device=device)[order]
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        at = torch.searchsorted(sorted_keys, blocks).clamp(max=len(keys) - 1)
        hit = (slots >= 0) & (sorted_keys[at] == blocks)
        rows = hit.nonzero().flatten()
        at = at[rows]
        who = owner_t[at]
        positions = first_t[at] + slots[rows] % self.block_size
        start = torch.tensor([s.computed_before for s in steps], dtype=torch.int64, device=device)
        stop = start + torch.tensor([s.scheduled for s in steps], dtype=torch.int64, device=device)
        bad = (positions < start[who]) | (positions >= stop[who])
        outside = set(who[bad].tolist())
        by_owner = torch.argsort(who, stable=True)
        counts = torch.bincount(who, minlength=len(steps)).tolist()
        row_groups = torch.split(rows[by_owner], counts)
        pos_groups = torch.split(positions[by_owner], counts)
        grouped = {i: (row_groups[i], pos_groups[i]) for i, n in enumerate(counts) if n}
        return grouped, outside


_EMPTY = torch.zeros(0, dtype=torch.int64)
