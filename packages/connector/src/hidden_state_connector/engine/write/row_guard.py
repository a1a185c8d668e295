"""A guard against silent wrong data: hidden-state rows vLLM never stored.

A row is one token's hidden state at one captured layer. After a decoder layer the
residual stream is never exactly zero, so a row whose every element is (+/-) zero was
not computed into the cache at all: the upstream failure modes are a whole sample of
zeros (hybrid models) or one layer's slot left empty (MoE models that skip the last
layer). Rows of layer id 0 (the embeddings) are exempt: an embedding table may hold a
zero vector (``padding_idx``).

The check reads the first 8 bytes of every checked row (one cache line per row, not a
pass over the data) and looks at a whole row only when those bytes are zero, so it
costs almost nothing per sample and still finds every all-zero row exactly. The row
count is guarded by ``RowCounter``: the rows written must be the token ids' count,
in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_PROBE_BYTES = 8


def _magnitude_mask(itemsize: int, nbytes: int) -> np.ndarray:
    """Little-endian bytes that clear each element's sign bit (``-0.0`` counts as zero)."""
    element = b"\xff" * (itemsize - 1) + b"\x7f"
    return np.frombuffer(element * (nbytes // itemsize), dtype=np.uint8)


@dataclass(frozen=True)
class ZeroRow:
    """The first all-zero row found: its token (within the sample) and layer id."""

    token: int
    layer_id: int

    def reason(self) -> str:
        """The failure recorded in the lock file and logged."""
        return (
            f"hidden states of token {self.token} at layer {self.layer_id} are all zero: "
            "vLLM did not store them (an architecture or configuration it cannot capture; "
            "see docs/connector.md, support matrix); the sample is not published"
        )


class ZeroRowCheck:
    """Finds all-zero rows in gathered chunks.

    Args:
        layer_ids: Captured layer ids, in layer-axis order.
        itemsize: Bytes per stored element (1 for fp8 bytes, 2 for bf16/fp16, 4 for fp32).
        hidden_size: Elements per row.
    """

    def __init__(self, layer_ids: Sequence[int], itemsize: int, hidden_size: int) -> None:
        if itemsize not in (1, 2, 4, 8):
            raise ValueError(f"unsupported element size {itemsize}")
        self.layer_ids = list(layer_ids)
        self.positions = [i for i, layer in enumerate(self.layer_ids) if layer != 0]
        self.itemsize = itemsize
        self.row_bytes = itemsize * hidden_size
        self._row_mask = _magnitude_mask(itemsize, self.row_bytes)
        # Rows of whole 8-byte words are probed by their first word (a strided read of
        # one word per row); other widths by their first bytes.
        self._words = self.row_bytes % _PROBE_BYTES == 0
        self._word_mask = self._row_mask[:_PROBE_BYTES].view(np.uint64)[0] if self._words else 0
        self._probe_bytes = min(_PROBE_BYTES, self.row_bytes)
        self._all_layers = self.positions == list(range(len(self.layer_ids)))

    def _heads_zero(self, rows: np.ndarray) -> np.ndarray:
        """``[tokens, checked layers]``: whether each checked row starts with zeros."""
        if self._words and rows.ctypes.data % _PROBE_BYTES == 0:
            words = rows.view(np.uint64)[:, :, 0]
            if not self._all_layers:
                words = words[:, self.positions]
            return (words & self._word_mask) == 0
        head = rows[:, :, : self._probe_bytes] & self._row_mask[: self._probe_bytes]
        if not self._all_layers:
            head = head[:, self.positions]
        return ~head.any(axis=2)

    def first_zero_row(self, rows: np.ndarray, first_token: int = 0) -> ZeroRow | None:
        """The first all-zero row of a chunk, or None.

        Args:
            rows: ``uint8`` array ``[tokens, layers, row_bytes]`` (a chunk's bytes),
                contiguous.
            first_token: Index of the chunk's first token within the sample.
        """
        if not self.positions or rows.shape[0] == 0:
            return None
        heads_zero = self._heads_zero(rows)
        if not heads_zero.any():
            return None
        for token, column in zip(*np.nonzero(heads_zero), strict=True):
            position = self.positions[int(column)]
            if not (rows[token, position] & self._row_mask).any():
                return ZeroRow(first_token + int(token), self.layer_ids[position])
        return None


class RowCounter:
    """Checks that chunks arrive in token order and add up to the token ids' count.

    Args:
        num_tokens: Rows the sample must have (its token ids' length).
    """

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.rows = 0

    def add(self, start: int, stop: int) -> str | None:
        """Count the rows ``[start, stop)`` of one chunk; why they do not fit, or None."""
        if start != self.rows or stop < start or stop > self.num_tokens:
            return (
                f"captured rows [{start}, {stop}) do not follow the {self.rows} rows before "
                f"them within {self.num_tokens} token ids; the sample is not published"
            )
        self.rows = stop
        return None

    def missing(self) -> str | None:
        """Why the rows do not cover every token id, or None when they do."""
        if self.rows != self.num_tokens:
            return (
                f"{self.rows} rows of hidden states were captured for {self.num_tokens} "
                "token ids; the sample is not published"
            )
        return None
