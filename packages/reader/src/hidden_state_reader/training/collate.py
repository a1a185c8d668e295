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

Raw fp8 samples (``raw_fp8=True``) keep their scales: the batch carries
``hidden_states_scales`` laid out like ``hidden_states`` (zero for padding), and
``hidden_state_reader.dequantize(batch["hidden_states"], batch["hidden_states_scales"])`` gives
the values. fp8 hidden states without scales are refused, never batched as numbers.

Each batch is built once (``build_into``, ``batch_memory.InPlaceCollate``): its tensors
are carved out of one buffer an allocator gives, each sample's rows copied into place.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from hidden_state_reader.format.fp8 import SCALES
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training.batch_memory import (
    Allocate,
    TensorSpec,
    allocate_plain,
    carve,
    copy_rows,
    layout,
    zero,
)

log = logging.getLogger(__name__)

_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


class _Item:
    """One validated batch element."""

    __slots__ = ("hidden_states", "label", "loss_mask", "path", "scales", "token_ids")

    def __init__(
        self,
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        path: str,
        label: str,
        loss_mask: torch.Tensor | None,
        scales: torch.Tensor | None,
    ):
        self.token_ids = token_ids
        self.hidden_states = hidden_states
        self.path = path
        self.label = label
        self.loss_mask = loss_mask
        self.scales = scales

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


def _item(index: int, element: Any) -> _Item:
    """Unpack and check one batch element."""
    mask = scales = None
    if isinstance(element, Sample):
        tokens, hidden, path = element.token_ids, element.hidden_states, element.path
        mask, scales = element.loss_mask, element.hidden_states_scales
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
    _check_scales(hidden, scales, label)
    mask = _checked_mask(mask, tokens.shape[0], label)
    return _Item(tokens, hidden, path, label, mask, scales)


def _check_scales(hidden: torch.Tensor, scales: Any, label: str) -> None:
    """fp8 hidden states need their scales: without them the codes are not the values."""
    if scales is None:
        if hidden.dtype in _FP8_DTYPES:
            raise ValueError(
                f"{label}: hidden states are raw {hidden.dtype} codes without their scales; "
                "pass the Sample (it carries hidden_states_scales), or read without "
                "raw_fp8=True to get dequantized values"
            )
        return
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dim() != 3
        or scales.shape[0] != hidden.shape[0]
        or scales.shape[1] not in (1, hidden.shape[1])
        or scales.shape[2] != 1
    ):
        shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(
            f"{label}: hidden_states_scales {shape} do not fit hidden states "
            f"{tuple(hidden.shape)} (expected [tokens, layers or 1, 1])"
        )


def _items(batch: Sequence[Any]) -> list[_Item]:
    """Unpack and check a batch: same layer count, hidden size, dtype and scales throughout."""
    if len(batch) == 0:
        raise ValueError("cannot collate an empty batch")
    items = [_item(index, element) for index, element in enumerate(batch)]
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
        if _scale_shape(item) != _scale_shape(first):
            raise ValueError(
                f"cannot batch fp8 samples with different scale layouts: {item.label} has "
                f"scales {_scale_shape(item)}, {first.label} has {_scale_shape(first)} "
                "(dequantize on load, or batch files of one writer setting)"
            )
    return items


def _scale_shape(item: _Item) -> tuple[int, ...] | None:
    return None if item.scales is None else tuple(item.scales.shape[1:])


def _allocator(items: Sequence[_Item], allocate: Allocate | None) -> Allocate:
    """``allocate``, unless the samples live on a device (read with ``device=``): there."""
    device = items[0].hidden_states.device
    if device.type != "cpu":
        return lambda specs: _on_device(specs, device)
    return allocate or allocate_plain


def _on_device(specs: Sequence[TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    return carve(torch.empty(layout(specs)[1], dtype=torch.uint8, device=device), specs)


class PadCollate:
    """Pad a batch to ``[B, T]``.

    Returns a dict with ``input_ids`` ``[B, T]`` int64 (filled with ``pad_token_id``),
    ``hidden_states`` ``[B, T, L, H]`` (zeros past each sequence's end, the samples'
    dtype), ``attention_mask`` ``[B, T]`` bool, ``loss_mask`` ``[B, T]`` bool and
    ``has_loss_mask`` ``[B]`` bool (see the module docstring), ``lengths`` ``[B]`` int64
    and ``paths`` (the source files; ``""`` for plain pairs); for raw fp8 samples also
    ``hidden_states_scales`` ``[B, T, L or 1, 1]`` float32.

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

    def __call__(self, batch: Sequence[Any], allocate: Allocate | None = None) -> dict[str, Any]:
        """Collate ``batch`` (Samples or ``(token_ids, hidden_states)`` pairs).

        Args:
            batch: The samples.
            allocate: Where the batch's tensors are made (default: ``allocate_plain``).
        """
        return self.build_into(batch, allocate or allocate_plain)

    def build_into(self, samples: Sequence[Any], allocate: Allocate) -> dict[str, Any]:
        """Build the batch in the tensors ``allocate`` gives (``InPlaceCollate``)."""
        items = _items(samples)
        lengths = [_cap(item.token_ids.shape[0], self.max_length) for item in items]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        hidden0, size = items[0].hidden_states, len(items)
        specs: list[TensorSpec] = [
            ("hidden_states", (size, width, *hidden0.shape[1:]), hidden0.dtype),
            ("input_ids", (size, width), torch.int64),
            ("attention_mask", (size, width), torch.bool),
            ("loss_mask", (size, width), torch.bool),
            ("lengths", (size,), torch.int64),
            ("has_loss_mask", (size,), torch.bool),
        ]
        if items[0].scales is not None:
            specs.append((SCALES, (size, width, *items[0].scales.shape[1:]), torch.float32))
        out: dict[str, Any] = _allocator(items, allocate)(specs)
        out["input_ids"].fill_(self.pad_token_id)
        out["attention_mask"].zero_()
        out["loss_mask"].zero_()
        for row, (item, n) in enumerate(zip(items, lengths, strict=True)):
            _fill_padded(out["hidden_states"][row], item.hidden_states, n)
            if item.scales is not None:
                _fill_padded(out[SCALES][row], item.scales, n)
            out["input_ids"][row, :n] = item.token_ids[:n]
            out["attention_mask"][row, :n] = True
            out["loss_mask"][row, :n] = item.trained(n)
        _fill_sample_fields(out, items, lengths)
        return out

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
    ``[B]`` bool (see the module docstring), ``lengths`` ``[B]`` int64 and ``paths``;
    for raw fp8 samples also ``hidden_states_scales`` ``[1, N, L or 1, 1]`` float32.

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

    def __call__(self, batch: Sequence[Any], allocate: Allocate | None = None) -> dict[str, Any]:
        """Collate ``batch`` (Samples or ``(token_ids, hidden_states)`` pairs).

        Args:
            batch: The samples.
            allocate: Where the batch's tensors are made (default: ``allocate_plain``).
        """
        return self.build_into(batch, allocate or allocate_plain)

    def build_into(self, samples: Sequence[Any], allocate: Allocate) -> dict[str, Any]:
        """Build the batch in the tensors ``allocate`` gives (``InPlaceCollate``)."""
        items = _items(samples)
        lengths = self._lengths(items)
        total, size, hidden0 = sum(lengths), len(items), items[0].hidden_states
        specs: list[TensorSpec] = [
            ("hidden_states", (1, total, *hidden0.shape[1:]), hidden0.dtype),
            ("input_ids", (1, total), torch.int64),
            ("position_ids", (1, total), torch.int64),
            ("seq_ids", (1, total), torch.int64),
            ("loss_mask", (1, total), torch.bool),
            ("cu_seqlens", (size + 1,), torch.int32),
            ("lengths", (size,), torch.int64),
            ("has_loss_mask", (size,), torch.bool),
        ]
        if items[0].scales is not None:
            specs.append((SCALES, (1, total, *items[0].scales.shape[1:]), torch.float32))
        out: dict[str, Any] = _allocator(items, allocate)(specs)
        start = 0
        for index, (item, n) in enumerate(zip(items, lengths, strict=True)):
            end = start + n
            copy_rows(out["hidden_states"][0, start:end], item.hidden_states[:n])
            if item.scales is not None:
                copy_rows(out[SCALES][0, start:end], item.scales[:n])
            out["input_ids"][0, start:end] = item.token_ids[:n]
            out["position_ids"][0, start:end] = torch.arange(n)
            out["seq_ids"][0, start:end] = index
            out["loss_mask"][0, start:end] = item.trained(n)
            start = end
        out["cu_seqlens"][0] = 0
        out["cu_seqlens"][1:].copy_(torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0))
        _fill_sample_fields(out, items, lengths)
        out["max_seqlen"] = max(lengths)
        return out

    def _lengths(self, items: Sequence[_Item]) -> list[int]:
        """Tokens of each item in the pack: all of them, until the budget runs out."""
        lengths, budget = [], self.max_tokens
        for item in items:
            n = _cap(item.token_ids.shape[0], budget)
            lengths.append(n)
            if budget is not None:
                budget -= n
        if self.max_tokens is not None and sum(lengths) < sum(i.token_ids.shape[0] for i in items):
            log.debug("pack truncated to max_tokens=%d: lengths %s", self.max_tokens, lengths)
        return lengths

    def __repr__(self) -> str:
        return f"PackCollate(max_tokens={self.max_tokens})"


def _fill_padded(row: torch.Tensor, source: torch.Tensor, n: int) -> None:
    """``row[:n] = source[:n]`` and zeros after it."""
    copy_rows(row[:n], source[:n])
    zero(row[n:])


def _fill_sample_fields(out: dict[str, Any], items: Sequence[_Item], lengths: list[int]) -> None:
    """The per-sample fields both collates return: lengths, has_loss_mask, paths."""
    out["lengths"].copy_(torch.tensor(lengths, dtype=torch.int64))
    out["has_loss_mask"].copy_(torch.tensor([i.loss_mask is not None for i in items]))
    out["paths"] = [item.path for item in items]


def _cap(n: int, limit: int | None) -> int:
    return n if limit is None else max(0, min(n, limit))


pad_collate = PadCollate()
"""``PadCollate()`` with the defaults: pad id 0, no rounding, no truncation."""

pack_collate = PackCollate()
"""``PackCollate()`` with no token budget."""
