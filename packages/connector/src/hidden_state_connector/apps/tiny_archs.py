"""Tiny random models of several architectures, built from ``transformers``' config classes.

``build_tiny_model(..., arch=NAME)`` uses these: each entry makes the config and the
model class of one architecture at the tiny model's size (hidden 128, head size 64,
byte-level vocabulary), with the smallest expert and latent sizes vLLM's CPU build and
Hugging Face both load. The byte-level tokenizer of ``tiny_model`` serves every
architecture (their real tokenizers are not needed for random weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinySize:
    """What every architecture shares: sizes and the tokenizer's ids."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    def common(self) -> dict[str, Any]:
        """Config keys every architecture takes alike."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "max_position_embeddings": 4096,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
        }


def _llama(size: TinySize) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **size.common(),
        intermediate_size=size.hidden_size * 2,
        num_key_value_heads=size.num_heads,
    )
    return config, LlamaForCausalLM


def _qwen3(size: TinySize) -> tuple[Any, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **size.common(),
        intermediate_size=size.hidden_size * 2,
        num_key_value_heads=1,
        head_dim=size.head_dim,
    )
    return config, Qwen3ForCausalLM


def _qwen3_moe(size: TinySize) -> tuple[Any, Any]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **size.common(),
        intermediate_size=size.hidden_size * 2,
        moe_intermediate_size=size.hidden_size // 2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        num_key_value_heads=1,
        head_dim=size.head_dim,
    )
    return config, Qwen3MoeForCausalLM


def _gpt_oss(size: TinySize) -> tuple[Any, Any]:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **size.common(),
        intermediate_size=size.hidden_size,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=1,
        head_dim=size.head_dim,
        sliding_window=16,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(size.num_layers)
        ],
    )
    return config, GptOssForCausalLM


def _deepseek_v2(size: TinySize) -> tuple[Any, Any]:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **size.common(),
        intermediate_size=size.hidden_size * 2,
        moe_intermediate_size=size.hidden_size // 2,
        num_key_value_heads=size.num_heads,
        kv_lora_rank=512,  # what vLLM's MLA backends take
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        # DeepSeek-V2's own YaRN scaling (vLLM's deepseek_yarn rotary embedding).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    )
    return config, DeepseekV2ForCausalLM


def _gemma3(size: TinySize) -> tuple[Any, Any]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **size.common(),
        intermediate_size=size.hidden_size * 2,
        num_key_value_heads=1,
        head_dim=size.head_dim,
        sliding_window=16,
        # Sliding-window and full-attention layers in turn (Gemma 3 has five to one).
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(size.num_layers)
        ],
    )
    return config, Gemma3ForCausalLM


def _nemotron_h(size: TinySize) -> tuple[Any, Any]:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    # Mamba-2, attention and MLP layers in turn (the hybrid's layer kinds).
    kinds = ["linear_attention", "mlp", "full_attention", "mlp"]
    common = size.common()
    common.pop("num_hidden_layers")
    config = NemotronHConfig(
        **common,
        layers_block_type=[kinds[i % len(kinds)] for i in range(size.num_layers)],
        intermediate_size=size.hidden_size * 2,
        num_key_value_heads=1,
        head_dim=size.head_dim,
        mamba_num_heads=4,
        mamba_head_dim=size.hidden_size // 2,
        ssm_state_size=16,
        n_groups=1,
        use_mamba_kernels=False,
    )
    return config, NemotronHForCausalLM


ARCHITECTURES: dict[str, Callable[[TinySize], tuple[Any, Any]]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v2": _deepseek_v2,
    "gemma3": _gemma3,
    "nemotron_h": _nemotron_h,
}
"""Architecture name (``hidden-state tiny-model --arch``) -> its config and model class."""


def tiny_config(arch: str, size: TinySize) -> tuple[Any, Any]:
    """The ``transformers`` config and model class of a tiny ``arch`` model.

    Raises:
        ValueError: Unknown architecture (the message lists the known ones).
    """
    make = ARCHITECTURES.get(arch)
    if make is None:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    return make(size)
