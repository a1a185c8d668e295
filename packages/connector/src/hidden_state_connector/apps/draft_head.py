"""A small EAGLE-style draft head trained on captured hidden states.

The target model's hidden states of ``L`` layers are normalised, concatenated and fused
back to the model width (``Linear(L*H, H)``, as EAGLE-3 does), run through one causal
Transformer layer, and projected onto the vocabulary by a trainable LM head that
predicts the next token at every position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn


class DecoderLayer(nn.Module):
    """One pre-norm causal self-attention + MLP block.

    Args:
        hidden_size: Model width.
        num_heads: Attention heads (must divide ``hidden_size``).
        mlp_ratio: MLP width as a multiple of ``hidden_size``.
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide hidden_size={hidden_size}")
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_ratio * hidden_size),
            nn.GELU(),
            nn.Linear(mlp_ratio * hidden_size, hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> ``[B, T, H]``; position t sees positions <= t only."""
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        heads = (batch, length, self.num_heads, width // self.num_heads)
        q, k, v = (t.reshape(heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class DraftHead(nn.Module):
    """Fuse captured layers, one decoder layer, LM head.

    Args:
        num_layers: Captured layers per token (``L``).
        hidden_size: Target model width (``H``).
        vocab_size: Size of the predicted vocabulary.
        num_heads: Attention heads of the decoder layer (default: ``H / 64``, at least 1).
    """

    def __init__(
        self, num_layers: int, hidden_size: int, vocab_size: int, num_heads: int | None = None
    ) -> None:
        super().__init__()
        if num_heads is None:
            num_heads = max(1, hidden_size // 64)
            while hidden_size % num_heads:
                num_heads -= 1
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.fuse = nn.Linear(num_layers * hidden_size, hidden_size)
        self.block = DecoderLayer(hidden_size, num_heads)
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            hidden_states: ``[B, T, L, H]`` captured states (any float dtype).

        Returns:
            ``[B, T, vocab_size]`` float32 logits; position t predicts token t + 1.
        """
        x = hidden_states.float()
        # Layers of a deep model differ in scale by orders of magnitude: RMS-normalise
        # each one before fusing, so no layer drowns the others.
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        x = self.fuse(x.flatten(2))
        return self.lm_head(self.norm(self.block(x)))


def next_token_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of predicting ``input_ids[:, t + 1]`` from position ``t``.

    Args:
        logits: ``[B, T, V]``.
        input_ids: ``[B, T]`` token ids (padding anywhere the mask is False).
        attention_mask: ``[B, T]`` bool, True on real tokens.

    Returns:
        The loss and the number of predicted tokens it averages over.
    """
    labels = input_ids[:, 1:].clone()
    valid = attention_mask[:, 1:] & attention_mask[:, :-1]
    labels[~valid] = -100
    count = int(valid.sum())
    if count == 0:
        return logits.sum() * 0.0, 0
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    return loss, count
