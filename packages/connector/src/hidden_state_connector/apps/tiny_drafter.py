"""A tiny EAGLE-3 drafter for a tiny target, to try forward capture beside a drafter offline.

``build_tiny_eagle3(directory, target)`` writes a one-layer EAGLE-3 drafter (float32) for a
model built by ``build_tiny_model`` (same width, heads and vocabulary), in the layout of
published EAGLE-3 checkpoints (``midlayer.*``, ``fc``, ``norm``, ``lm_head``; the
embeddings are the target's), which vLLM's ``LlamaForCausalLMEagle3`` loads
(``speculative_config={"method": "eagle3", "model": directory, ...}``). Random, its
drafts are all rejected. ``echo=True`` makes its attention and MLP add nothing and its head
the target's own last layer, norm and LM head: it drafts again the token the target just
chose, accepted wherever the target repeats a token (a random tiny model soon does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_tiny_eagle3(
    directory: str | Path, target: str | Path, *, seed: int = 1, echo: bool = False
) -> Path:
    """A one-layer EAGLE-3 drafter (float32) for the tiny model at ``target`` (random or echo)."""
    directory, target = Path(directory), Path(target)
    config = json.loads((target / "config.json").read_text())
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    directory.mkdir(parents=True, exist_ok=True)
    draft = _draft_config(config)
    (directory / "config.json").write_text(json.dumps(draft, indent=2))
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen) * 0.02

    layer = "midlayer."
    tensors = {
        f"{layer}self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": w(inter, hidden),
        f"{layer}mlp.up_proj.weight": w(inter, hidden),
        f"{layer}mlp.down_proj.weight": w(hidden, inter),
        f"{layer}input_layernorm.weight": torch.ones(hidden),
        f"{layer}hidden_norm.weight": torch.ones(hidden),
        f"{layer}post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": w(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    if echo:  # the residual stream is fc's pick of the target's last layer, unchanged
        own = load_file(str(target / "model.safetensors"))
        tensors[f"{layer}self_attn.o_proj.weight"].zero_()
        tensors[f"{layer}mlp.down_proj.weight"].zero_()
        tensors["fc.weight"] = torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], 1)
        tensors["norm.weight"] = own["model.norm.weight"].float().clone()
        tensors["lm_head.weight"] = own["lm_head.weight"].float().clone()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _draft_config(config: dict[str, Any]) -> dict[str, Any]:
    """The drafter's ``config.json`` for a target of ``config``."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config["num_key_value_heads"]),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "num_hidden_layers": 1,
        "vocab_size": int(config["vocab_size"]),
        "draft_vocab_size": int(config["vocab_size"]),
        "max_position_embeddings": int(config.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        # Three distinct target layers (vLLM's default (2, n // 2, n - 3) repeats one
        # for a 4-layer target, and ``fc`` takes three).
        "eagle_aux_hidden_state_layer_ids": [1, 2, int(config["num_hidden_layers"])],
    }
