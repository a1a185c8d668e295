"""``Sample``: what the reader yields. Unpacks as ``(token_ids, hidden_states)``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Sample:
    """One request's hidden states.

    ``token_ids, hidden_states = sample`` works like a 2-tuple; the other fields are
    there for whoever needs them.

    Attributes:
        token_ids: ``[tokens]`` int64.
        hidden_states: ``[tokens, layers, hidden]`` (layers as selected on read).
        path: The file it was read from.
        metadata: The writer's ``__metadata__`` map (empty for vLLM-written files).
        layer_ids: Captured layer ids of the layer axis, when known.
        loss_mask: ``[tokens]`` ``torch.bool``, True where the loss counts the token
            (assistant or generated tokens), or None when the file has no mask.
        hidden_states_scales: float32 fp8 scales (``[tokens, layers, 1]`` or
            ``[tokens, 1, 1]``) when ``hidden_states`` is raw fp8 (``raw_fp8=True``),
            else None.
    """

    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    path: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    layer_ids: list[int] | None = None
    loss_mask: torch.Tensor | None = None
    hidden_states_scales: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        # A tuple's iterator, not a generator: unpacking runs once per sample.
        return iter((self.token_ids, self.hidden_states))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.token_ids, self.hidden_states)[index]

    @property
    def num_tokens(self) -> int:
        """Sequence length."""
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held by this sample."""
        n = self.token_ids.nbytes + self.hidden_states.nbytes
        if self.loss_mask is not None:
            n += self.loss_mask.nbytes
        if self.hidden_states_scales is not None:
            n += self.hidden_states_scales.nbytes
        return n

    def __repr__(self) -> str:
        mask = "" if self.loss_mask is None else f", loss_mask={int(self.loss_mask.sum())} trained"
        return (
            f"Sample(path={self.path!r}, tokens={self.num_tokens}, "
            f"hidden_states={tuple(self.hidden_states.shape)} {self.hidden_states.dtype}{mask})"
        )
