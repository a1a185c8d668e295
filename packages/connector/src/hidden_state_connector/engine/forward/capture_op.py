"""The capture as one PyTorch operator, so ``torch.compile`` and CUDA graphs keep it.

A Python forward hook that writes into a tensor is traced by Dynamo like any other code,
but a slice write into a buffer the graph does not own can be moved, fused away or turned
into a copy of the whole buffer. An opaque custom operator that declares it mutates the
staging rows stays one call at its place in the graph: Inductor writes into the buffer in
place, and a CUDA graph records the write at the buffer's fixed address.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

OPERATOR = "hidden_state_capture::store_rows"


@functools.cache
def store_rows_op() -> Any:
    """``store_rows(rows, axis, hidden, residual)``, registered on first use.

    It writes ``hidden (+ residual)`` into ``rows[axis, :n]`` (``n``: the batch's tokens).
    Registration is a process-wide side effect, hence lazy rather than at import.
    """

    @torch.library.custom_op(OPERATOR, mutates_args=("rows",))
    def store_rows(
        rows: torch.Tensor, axis: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        n = hidden.shape[0]
        if n > rows.shape[1]:
            raise RuntimeError(
                f"forward capture: {n} tokens in one forward pass, staging holds "
                f"{rows.shape[1]} (max_num_batched_tokens)"
            )
        out = rows[axis, :n]
        if residual is None:
            out.copy_(hidden)
        else:
            torch.add(hidden, residual, out=out)

    @store_rows.register_fake
    def _(
        rows: torch.Tensor, axis: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        return None

    return torch.ops.hidden_state_capture.store_rows.default
