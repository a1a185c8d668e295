"""Which row of a step's batch belongs to which captured request, at which position.

The runner may order requests in the batch as it likes (and pads it for CUDA graphs), so
the order is not assumed. Each row's KV slot (the forward context's slot mapping, which
the attention layers write through) names a block; a block belongs to exactly one
running request (prefix caching, which shares blocks, is refused), and its index in that
request's block table gives the row's position. The table has one home, the scheduler
half (``SchedulerSide``); it sends each captured request's token range of this step and
the blocks of its table that hold them (``StepRows``); rows that do not add up to the
scheduled count fail that request's sample instead of storing wrong rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_connector.engine.metadata import StepRows


def rows_of_step(step: Any, block_table: list[int], block_size: int) -> StepRows:
    """The ``StepRows`` of a ``compat.ScheduledRequest`` (scheduler side).

    ``block_table``: the request's whole table. The blocks of this step's tokens are
    copied out of it (a slice): the worker may read a step after the scheduler has added
    later blocks (the ingest thread runs behind; both halves share objects in one process).
    """
    first = step.computed_before // block_size
    last = (step.computed_before + step.scheduled - 1) // block_size
    blocks = block_table[first : last + 1]
    return StepRows(step.req_id, step.computed_before, step.scheduled, blocks, len(block_table))


@dataclass
class FlatRoute:
    """A step's matched rows, flat.

    Attributes:
        rows: Row indices into the step's batch.
        owner: The step entry (index into the step's ``StepRows``) of each row.
        positions: The token position of each row.
        failures: Why an entry's rows cannot be trusted, by entry index.
    """

    rows: torch.Tensor
    owner: torch.Tensor
    positions: torch.Tensor
    failures: dict[int, str]


class RowRouter:
    """Routes each step's rows through the blocks its ``StepRows`` name.

    Args:
        block_size: Tokens per block of the attention group the slot mapping indexes.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def route_flat(self, slots: torch.Tensor, steps: Sequence[StepRows]) -> FlatRoute:
        """Every matched row of the batch with its step entry and position, in one pass.

        Python work is per step entry and block, tensor work per batch: the cost of a
        decode step of hundreds of requests stays a few tensor operations.
        """
        bs = self.block_size
        keys: list[int] = []
        key_owner: list[int] = []
        first_pos: list[int] = []
        failures: dict[int, str] = {}
        for index, step in enumerate(steps):
            blocks = step.block_ids  # of block ``lo`` on
            lo = step.computed_before // bs
            hi = (step.computed_before + step.scheduled - 1) // bs
            if step.scheduled > 0 and hi - lo >= len(blocks):
                failures[index] = f"block table of {step.table_blocks} blocks lacks block {hi}"
                continue
            keys.extend(blocks)
            key_owner.extend([index] * len(blocks))
            first_pos.extend(range(lo * bs, (lo + len(blocks)) * bs, bs))
        rows, owner, positions = self._lookup(slots.to(torch.int64), keys, key_owner, first_pos)
        start = torch.tensor([st.computed_before for st in steps], dtype=torch.int64)
        scheduled = torch.tensor([st.scheduled for st in steps], dtype=torch.int64)
        counts = torch.bincount(owner, minlength=len(steps))
        outside = (positions < start[owner]) | (positions >= (start + scheduled)[owner])
        wrong = (counts != scheduled).clone()
        wrong[owner[outside]] = True
        for index in wrong.nonzero().flatten().tolist():
            if index not in failures:
                step = steps[index]
                failures[index] = (
                    f"{int(counts[index])} rows of the batch map to tokens "
                    f"[{step.computed_before}, {step.computed_before + step.scheduled}) of "
                    f"this request, expected {step.scheduled}"
                )
        return FlatRoute(rows, owner, positions, failures)

    def _lookup(
        self, slots: torch.Tensor, keys: list[int], owner: list[int], first_pos: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``slots`` whose block is one of ``keys``; their owner and position."""
        if not keys or slots.numel() == 0:
            return _EMPTY, _EMPTY, _EMPTY
        slots = slots.cpu()
        key_t = torch.tensor(keys, dtype=torch.int64)
        order = torch.argsort(key_t)
        sorted_keys = key_t[order]
        owner_t = torch.tensor(owner, dtype=torch.int64)[order]
        first_t = torch.tensor(first_pos, dtype=torch.int64)[order]
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        at = torch.searchsorted(sorted_keys, blocks).clamp(max=len(keys) - 1)
        hit = (slots >= 0) & (sorted_keys[at] == blocks)
        rows = hit.nonzero().flatten()
        at = at[rows]
        return rows, owner_t[at], first_t[at] + slots[rows] % self.block_size


_EMPTY = torch.zeros(0, dtype=torch.int64)
