"""Which tokens a drafter is trained on: the sample's ``loss_mask``, or a default rule.

speculators' ``prepare-data`` masks a rendered conversation at its last assistant-turn
boundary: 0 for every token before it, 1 for the response after it
(``[0] * boundary + [1] * (len - boundary)``). A sample written while vLLM generated
records that boundary as ``num_prompt_tokens``: the tokens after it are the target
model's own response, so the ``generated`` rule masks exactly those, as prepare-data
would. A sample without generated tokens (prefill only, as ``hidden-state extract``
writes by default) has no boundary to go by; both rules then train on every token.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from hidden_state_reader.errors import CorruptSampleError
from hidden_state_reader.format.header import Meta

if TYPE_CHECKING:
    import numpy as np


class DefaultMask(str, enum.Enum):
    """The rule for samples that carry no ``loss_mask`` of their own."""

    GENERATED = "generated"
    """1 for the tokens after ``num_prompt_tokens`` when there are any, else all ones."""
    ALL = "all"
    """1 for every token."""


class MaskSource(str, enum.Enum):
    """Where a row's loss mask came from (recorded per row in ``export.jsonl``)."""

    FILE = "file"  # the sample's own loss_mask tensor
    GENERATED = "generated"  # the tokens after num_prompt_tokens
    ALL = "all"  # every token


def prompt_length(metadata: Any, num_tokens: int, path: str) -> int | None:
    """The writer's ``num_prompt_tokens``, or None when it did not record one.

    Raises:
        CorruptSampleError: The value is not an integer between 0 and the token count.
    """
    raw = metadata.get(Meta.NUM_PROMPT_TOKENS) if metadata else None
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise CorruptSampleError(
            path, f"metadata num_prompt_tokens is not an integer: {raw!r}"
        ) from None
    if not 0 <= value <= num_tokens:
        raise CorruptSampleError(
            path, f"metadata num_prompt_tokens={value} is outside 0..{num_tokens} tokens"
        )
    return value


def loss_mask(sample: Any, rule: DefaultMask) -> tuple[np.ndarray, MaskSource]:
    """The 0/1 loss mask of one sample, as int64 (the dtype prepare-data writes).

    Args:
        sample: A ``Sample``; its ``loss_mask`` (``[tokens]``, 0/1) is used when present.
        rule: What to do for a sample without one.

    Returns:
        The mask ``[tokens]`` and where it came from.

    Raises:
        CorruptSampleError: The sample's ``loss_mask`` has the wrong length or values
            other than 0 and 1, or its ``num_prompt_tokens`` is malformed.
    """
    import numpy as np

    n = sample.num_tokens
    own = getattr(sample, "loss_mask", None)
    if own is not None:
        mask = own.detach().to("cpu").reshape(-1).numpy().astype(np.int64)
        if mask.shape[0] != n:
            raise CorruptSampleError(
                sample.path, f"loss_mask has {mask.shape[0]} entries for {n} tokens"
            )
        if mask.size and not np.isin(mask, (0, 1)).all():
            raise CorruptSampleError(sample.path, "loss_mask holds values other than 0 and 1")
        return mask, MaskSource.FILE
    mask = np.ones(n, dtype=np.int64)
    if rule is DefaultMask.GENERATED:
        prompt = prompt_length(sample.metadata, n, sample.path)
        if prompt is not None and prompt < n:
            mask[:prompt] = 0
            return mask, MaskSource.GENERATED
    return mask, MaskSource.ALL
