"""``verify_file``: does a final sample file hold this prompt's hidden states?

Checks the token ids (exactly, or as a prefix when generated tokens may follow), the
loss mask (the record's, generated tokens 1; none for a record without one), the
recorded layers and the recorded prompt length. ``hidden_state_reader`` (and so torch)
is imported only when a file is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hidden_state_reader.format import SampleHeader


def verify_file(
    path: str,
    prompt: Sequence[int],
    *,
    layer_ids: Sequence[int],
    include_output: bool,
    expected: Sequence[int] | None = None,
    loss_mask: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Check that a final sample file holds this prompt's hidden states.

    Args:
        path: The sample file.
        prompt: The prompt's token ids.
        layer_ids: The captured layers the file must record (when it records any).
        include_output: Generated tokens may follow the prompt.
        expected: The exact token ids the file must hold (when known).
        loss_mask: The prompt's mask; the file's must start with it and mark every
            generated token 1. None: the file must hold no mask.

    Returns:
        ``(tokens, bytes)`` of the file.

    Raises:
        ValueError: The file does not match; the message says how.
        hidden_state_reader.SampleError: The file is incomplete or corrupt.
        OSError: It cannot be read.
    """
    from hidden_state_reader.apps.cli.toolkit import read_token_ids
    from hidden_state_reader.files.header import read_header
    from hidden_state_reader.format import Meta

    header = read_header(path)
    tokens = read_token_ids(path, header)
    n = len(prompt)
    if expected is not None:
        if tokens != list(expected):
            raise ValueError(
                f"its {len(tokens)} token ids differ from the {len(expected)} expected"
            )
    elif include_output:
        if tokens[:n] != list(prompt):
            raise ValueError(f"its token ids do not start with the prompt's {n} tokens")
    elif tokens != list(prompt):
        raise ValueError(f"its {len(tokens)} token ids differ from the prompt's {n}")
    _check_mask(path, header, loss_mask, len(tokens))
    recorded = header.layer_ids
    if recorded is not None and list(recorded) != list(layer_ids):
        raise ValueError(f"it holds layers {recorded}, not {list(layer_ids)}")
    prompt_meta = header.metadata.get(Meta.NUM_PROMPT_TOKENS)
    if prompt_meta is not None and prompt_meta != str(n):
        raise ValueError(f"it records {prompt_meta} prompt tokens, not {n}")
    return len(tokens), header.file_size


def _check_mask(
    path: str, header: SampleHeader, expected: Sequence[int] | None, num_tokens: int
) -> None:
    """The file's loss mask is the prompt's, generated tokens 1 (or absent, as expected)."""
    info = header.loss_mask
    if info is None or expected is None:
        if info is None and expected is not None:
            raise ValueError("it holds no loss_mask, but the record has one")
        if info is not None and expected is None:
            raise ValueError("it holds a loss_mask, but the record has none")
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stored = list(os.pread(fd, info.nbytes, header.data_start + info.begin))
    finally:
        os.close(fd)
    want = list(expected) + [1] * (num_tokens - len(expected))
    if stored != want:
        raise ValueError(f"its loss_mask differs from the record's ({sum(want)} tokens marked)")
