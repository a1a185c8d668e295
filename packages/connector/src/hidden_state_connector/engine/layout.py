"""How the hidden-state cache view is indexed: a pure type, importable without vLLM.

``compat.probe_layout`` finds the layout of the running engine's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheLayout:
    """How the hidden-state cache view is indexed.

    Attributes:
        token_axis: Axis (1 or 2) of the position inside a block; the other middle axis
            is the layer ("head") axis. 0.26: 1 (``[blocks, block_size, layers, hidden]``),
            0.32: 2 (``[blocks, layers, block_size, hidden]``).
        block_size: Tokens per block.
        num_layers: Captured layers.
        hidden_size: Width of one hidden state.
    """

    token_axis: int
    block_size: int
    num_layers: int
    hidden_size: int

    def blocks_tokens_layers(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """A ``[blocks, block_size, layers, hidden]`` view of the cache (no copy)."""
        return kv_cache if self.token_axis == 1 else kv_cache.transpose(1, 2)
