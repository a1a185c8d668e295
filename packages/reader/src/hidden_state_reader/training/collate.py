"""Batch collation: padding to a rectangle, or packing into one varlen sequence.

Both accept ``Sample`` objects and plain ``(token_ids, hidden_states)`` pairs, check that
the samples fit together (naming the files when they do not), and return a dict.

* ``PadCollate``: ``[B, T]`` batches with an attention mask, for ordinary attention.
* ``PackCollate``: all tokens in one ``[1, N]`` row with ``cu_seqlens`` and restarting
  ``position_ids``, for FlashAttention's varlen kernels and SDPA with document masks:
  no compute is spent on padding.

Both always return ``loss_mask`` (bool, the tokens the loss counts) and
``has_loss_mask`` (``[B]`` bool, which samples brought a mask of their own): a sample
without one (no ``loss_mask`` in its file, or a plain pair) counts all its tokens, so its
row equals its attention mask, and padding is always False. A batch that mixes masked
and unmasked samples therefore trains on the masked tokens of the ones and every token
of the others; trainers that want only masked data check ``has_loss_mask``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from hidden_state_reader.sample.sample import Sample

log = logging.getLogger(__name__)


class _Item:
    """One validated batch element."""

    __slots__ = ("hidden_states", "label", "loss_mask", "path", "token_ids")

    def __init__(
        self,
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        path: str,
        label: str,
        loss_mask: torch.Tensor | None,
    ):
        self.token_ids = token_ids
        self.hidden_states = hidden_states
        self.path = path
        self.label = label
        self.loss_mask = loss_mask

    def trained(self, n: int) -> torch.Tensor:
        """The first ``n`` entries of the loss mask (all True without a mask)."""
        if self.loss_mask is None:
            return torch.ones(n, dtype=torch.bool, device=self.token_ids.device)
        return self.loss_mask[:n]


def _checked_mask(mask: Any, num_tokens: int, label: str) -> torch.Tensor | None:
    """A sample's loss mask as ``[num_tokens]`` bool (None stays None)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1 or mask.shape[0] != num_tokens:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{label}: loss_mask must be a [{num_tokens}] tensor, got {shape}")
    if mask.dtype == torch.bool:
        return mask
    if (
        mask.is_floating_point()
        or mask.is_complex()
        or (mask.numel() and (int(mask.min()) < 0 or int(mask.max()) > 1))
    ):
        raise ValueError(f"{label}: loss_mask must be bool or hold only 0 and 1")
    return mask.to(torch.bool)


def _items(batch: Sequence[Any]) -> list[_Item]:
    """Unpack and check a batch: same layer count, hidden size and dtype throughout."""
    if len(batch) == 0:
        raise ValueError("cannot collate an empty batch")
    items = []
    for index, element in enumerate(batch):
        mask = None
        if isinstance(element, Sample):
            tokens, hidden, path = element.token_ids, element.hidden_states, element.path
            mask = element.loss_mask
        elif isinstance(element, (tuple, list)) and len(element) == 2:
            (tokens, hidden), path = element, ""
        else:
            raise TypeError(
                f"batch item {index}: expected a Sample or a (token_ids, hidden_states) pair, "
                f"got {type(element).__name__}"
            )
        label = path or f"batch item {index}"
        if not isinstance(tokens, torch.Tensor) or not isinstance(hidden, torch.Tensor):
            raise TypeError(f"{label}: token_ids and hidden_states must be tensors")
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(
                f"{label}: token_ids must be a 1-D integer tensor, got {tokens.dtype} "
                f"{tuple(tokens.shape)}"
            )
        if hidden.dim() != 3:
            raise ValueError(
                f"{label}: hidden_states must be [tokens, layers, hidden], got "
                f"shape {tuple(hidden.shape)}"
            )
        if hidden.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"{label}: {tokens.shape[0]} token ids but {hidden.shape[0]} hidden states"
            )
        mask = _checked_mask(mask, tokens.shape[0], label)
        items.append(_Item(tokens, hidden, path, label, mask))
    first = items[0]
    for item in items[1:]:
        if item.hidden_states.shape[1:] != first.hidden_states.shape[1:]:
            raise ValueError(
                f"cannot batch samples with different [layers, hidden]: {item.label} has "
                f"{list(item.hidden_states.shape[1:])}, {first.label} has "
                f"{list(first.hidden_states.shape[1:])} (select the same layers for all, e.g. "
                "layer_ids=...)"
            )
        if item.hidden_states.dtype != first.hidden_states.dtype:
            raise ValueError(
                f"cannot batch samples with different dtypes: {item.label} is "
                f"{item.hidden_states.dtype}, {first.label} is {first.hidden_states.dtype} "
                "(pass dtype=... to the reader to convert on load)"
            )
    return items


class PadCollate:
    """Pad a batch to ``[B, T]``.

    Returns a dict with ``input_ids`` ``[B, T]`` int64 (filled with ``pad_token_id``),
    ``hidden_states`` ``[B, T, L, H]`` (zeros past each sequence's end, the samples'
    dtype), ``attention_mask`` ``[B, T]`` bool, ``loss_mask`` ``[B, T]`` bool and
    ``has_loss_mask`` ``[B]`` bool (see the module docstring), ``lengths`` ``[B]`` int64
    and ``paths`` (the source files; ``""`` for plain pairs).

    Args:
        pad_token_id: Token id written into padding positions.
        pad_to_multiple_of: Round ``T`` up to a multiple of this (tensor-core friendly
            shapes, fewer recompilations).
        max_length: Truncate longer sequences to this many tokens (their ends are cut).
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        max_length: int | None = None,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if max_length is not None and pad_to_multiple_of and max_length % pad_to_multiple_of:
            raise ValueError(
                f"max_length={max_length} is not a multiple of pad_to_multiple_of="
                f"{pad_to_multiple_of}; padded batches could exceed it"
            )
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, batch: Sequence[Any]) -> dict[str, Any]:
        """Collate ``batch`` (Samples or ``(token_ids, hidden_states)`` pairs)."""
        items = _items(batch)
        lengths = [_cap(item.token_ids.shape[0], self.max_length) for item in items]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        hidden0 = items[0].hidden_states
        size = len(items)
        on = hidden0.device  # samples read with device="cuda" are batched there
        input_ids = torch.full((size, width), self.pad_token_id, dtype=torch.int64, device=on)
        hidden = torch.zeros((size, width, *hidden0.shape[1:]), dtype=hidden0.dtype, device=on)
        mask = torch.zeros((size, width), dtype=torch.bool, device=on)
        loss_mask = torch.zeros((size, width), dtype=torch.bool, device=on)
        for row, (item, n) in enumerate(zip(items, lengths, strict=True)):
            input_ids[row, :n] = item.token_ids[:n]
            hidden[row, :n] = item.hidden_states[:n]
            mask[row, :n] = True
            loss_mask[row, :n] = item.trained(n)
        return {
            "input_ids": input_ids,
            "hidden_states": hidden,
            "attention_mask": mask,
            "loss_mask": loss_mask,
            "has_loss_mask": _has_mask(items),
            "lengths": torch.tensor(lengths, dtype=torch.int64),
            "paths": [item.path for item in items],
        }

    def __repr__(self) -> str:
        return (
            f"PadCollate(pad_token_id={self.pad_token_id}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of}, max_length={self.max_length})"
        )


class PackCollate:
    """Pack a batch into one row of ``N`` tokens (no padding).

    Returns a dict with ``input_ids`` ``[1, N]`` int64, ``hidden_states``
    ``[1, N, L, H]``, ``position_ids`` ``[1, N]`` (restarting at 0 for each sequence),
    ``cu_seqlens`` ``[B + 1]`` int32 (sequence boundaries, as FlashAttention's varlen
    functions take them), ``max_seqlen`` (int), ``seq_ids`` ``[1, N]`` int64 (the batch
    index each token comes from), ``loss_mask`` ``[1, N]`` bool and ``has_loss_mask``
    ``[B]`` bool (see the module docstring), ``lengths`` ``[B]`` int64 and ``paths``.

    Args:
        max_tokens: Token budget of the pack. Sequences are packed in batch order; the
            one crossing the budget is truncated and any after it get length 0 (they
            stay in ``lengths``/``paths``/``cu_seqlens``, so nothing is silently
            renumbered).
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens

    def __call__(self, batch: Sequence[Any]) -> dict[str, Any]:
        """Collate ``batch`` (Samples or ``(token_ids, hidden_states)`` pairs)."""
        items = _items(batch)
        lengths = []
        budget = self.max_tokens
        for item in items:
            n = _cap(item.token_ids.shape[0], budget)
            lengths.append(n)
            if budget is not None:
                budget -= n
        if self.max_tokens is not None and sum(lengths) < sum(i.token_ids.shape[0] for i in items):
            log.debug("pack truncated to max_tokens=%d: lengths %s", self.max_tokens, lengths)
        counts = torch.tensor(lengths, dtype=torch.int64)
        cu_seqlens = torch.zeros(len(items) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(counts, 0)
        starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), counts)
        total = int(cu_seqlens[-1])
        return {
            "input_ids": torch.cat([i.token_ids[:n] for i, n in zip(items, lengths, strict=True)])
            .to(torch.int64)
            .unsqueeze(0),
            "hidden_states": torch.cat(
                [i.hidden_states[:n] for i, n in zip(items, lengths, strict=True)]
            ).unsqueeze(0),
            "position_ids": (torch.arange(total, dtype=torch.int64) - starts).unsqueeze(0),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max(lengths),
            "seq_ids": torch.repeat_interleave(torch.arange(len(items)), counts).unsqueeze(0),
            "loss_mask": torch.cat(
                [i.trained(n) for i, n in zip(items, lengths, strict=True)]
            ).unsqueeze(0),
            "has_loss_mask": _has_mask(items),
            "lengths": counts,
            "paths": [item.path for item in items],
        }

    def __repr__(self) -> str:
        return f"PackCollate(max_tokens={self.max_tokens})"


def _has_mask(items: Sequence[_Item]) -> torch.Tensor:
    return torch.tensor([item.loss_mask is not None for item in items], dtype=torch.bool)


def _cap(n: int, limit: int | None) -> int:
    return n if limit is None else max(0, min(n, limit))


pad_collate = PadCollate()
"""``PadCollate()`` with the defaults: pad id 0, no rounding, no truncation."""

pack_collate = PackCollate()
"""``PackCollate()`` with no token budget."""
