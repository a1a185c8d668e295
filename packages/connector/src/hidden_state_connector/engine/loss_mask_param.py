"""A client's loss mask in ``kv_transfer_params``: parse it on arrival, fit it at the end.

Two forms (at most one per request):

* ``"loss_mask": [0, 0, 1, 1, ...]``: one 0/1 (or ``true``/``false``) per stored token.
* ``"loss_mask_spans": [[start, end], ...]``: half-open ranges of prompt positions the
  loss counts; every other prompt position is 0. Ranges may be given in any order and
  may overlap (their union counts).

The stored tokens are the prompt, plus the generated tokens but the last with
``include_output_tokens``. Then the number generated is only known at the end, so a
mask (either form) that covers just the prompt is accepted and the generated tokens
get 1 (they are the model's own output, what a drafter learns from); a longer list must
cover every stored token exactly, which is checked when the request finishes.

Whatever is wrong is returned as a reason (never raised): the scheduler side refuses
the sample with it, and the client reads it in ``hidden_states_error``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MASK_PARAM = "loss_mask"
SPANS_PARAM = "loss_mask_spans"

Parsed = tuple["list[int] | None", "str | None"]
"""``(mask, None)``, ``(None, None)`` when no mask was sent, or ``(None, reason)``."""


def requested_mask(
    params: Mapping[str, Any], num_prompt: int | None, include_output: bool
) -> Parsed:
    """Validate the mask a request arrived with, as far as its prompt allows.

    Args:
        params: The request's ``kv_transfer_params``.
        num_prompt: Its prompt length (None: no prompt token ids).
        include_output: Whether generated tokens are stored too.

    Returns:
        The mask as 0/1 ints (the prompt's length, or longer with ``include_output``),
        None without one, or the reason it cannot be used.
    """
    mask, spans = params.get(MASK_PARAM), params.get(SPANS_PARAM)
    if mask is None and spans is None:
        return None, None
    if mask is not None and spans is not None:
        return None, f"send either {MASK_PARAM} or {SPANS_PARAM}, not both"
    if num_prompt is None:
        return None, f"{MASK_PARAM} needs a prompt of token ids (not prompt embeddings)"
    if spans is not None:
        return _from_spans(spans, num_prompt)
    return _from_list(mask, num_prompt, include_output)


def _from_list(mask: Any, num_prompt: int, include_output: bool) -> Parsed:
    if not isinstance(mask, list):
        return None, f"{MASK_PARAM} must be a list of 0/1, got {type(mask).__name__}"
    # This runs on the scheduler's thread: bytes() checks a long list in C, far faster
    # than a Python loop (docs/connector.md). It takes ints and bools (JSON true/false)
    # only; anything else, or a byte other than 0/1, is then found in Python.
    try:
        packed = bytes(mask)
    except (TypeError, ValueError):
        packed = b"\x02"
    if packed.translate(None, b"\x00\x01"):
        bad = next(i for i, v in enumerate(mask) if not (isinstance(v, int) and v in (0, 1)))
        return None, f"{MASK_PARAM}[{bad}] is {mask[bad]!r}; every entry must be 0 or 1"
    n = len(mask)
    if n == num_prompt or (include_output and n > num_prompt):
        return list(packed), None
    expected = (
        f"at least the prompt's {num_prompt} (one per stored token)"
        if include_output
        else f"one per stored token: the prompt's {num_prompt}"
    )
    return None, f"{MASK_PARAM} has {n} entries; expected {expected}"


def _from_spans(spans: Any, num_prompt: int) -> Parsed:
    if not isinstance(spans, list):
        return None, f"{SPANS_PARAM} must be a list of [start, end] pairs"
    mask = [0] * num_prompt
    for i, span in enumerate(spans):
        ok = (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
        )
        if not ok:
            return None, f"{SPANS_PARAM}[{i}] is {span!r}; expected [start, end] integers"
        start, end = span
        if not 0 <= start <= end <= num_prompt:
            return None, (
                f"{SPANS_PARAM}[{i}] is {span!r}; need 0 <= start <= end <= {num_prompt} "
                "(the prompt's length; end is exclusive)"
            )
        mask[start:end] = [1] * (end - start)
    return mask, None


def stored_mask(mask: list[int], num_prompt: int, num_stored: int) -> Parsed:
    """Fit an accepted mask to the tokens really stored (known when the request ends).

    Args:
        mask: What ``requested_mask`` returned.
        num_prompt: The prompt's length.
        num_stored: Tokens whose hidden states are saved.

    Returns:
        The ``[num_stored]`` mask (generated tokens 1 for a prompt-length mask), or why
        it does not fit.
    """
    if len(mask) == num_stored:
        return mask, None
    if len(mask) == num_prompt and num_stored > num_prompt:
        return mask + [1] * (num_stored - num_prompt), None
    return None, (
        f"{MASK_PARAM} has {len(mask)} entries but {num_stored} tokens are stored "
        f"({num_prompt} prompt, {num_stored - num_prompt} generated); send {num_prompt} "
        f"or {num_stored}"
    )
