"""What forward capture needs from a model family: its decoder layers, how they pass the residual.

A family is listed here only once its values were checked against Hugging Face float32
(tests/connector/test_forward_capture.py, test_forward_families.py). Any other
architecture is refused at start-up by name (``family_of``); so is a listed family in a
setting where its layers do not carry HF's residual stream (``Family.refusal``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_connector.engine.cpu_build import cpu_rotary_kernel


def _accepts(_vllm_config: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Family:
    """How one model family's vLLM implementation exposes its residual stream.

    Every family listed passes the stream the same way: each decoder layer returns
    ``(hidden, residual)`` and the stream after it is their sum; the first layer gets
    the embeddings (scaled already where the model scales them, as Gemma does inside
    ``embed_input_ids``) as ``hidden_states`` with no residual (``stream_before``).

    Attributes:
        name: Human name, for messages.
        layers_path: Attribute path from the loaded model to its decoder layer list.
        refusal: Given the engine's ``VllmConfig``, why this family's layers would not
            carry HF's values there (None: they do).
    """

    name: str
    layers_path: str = "model.layers"
    refusal: Callable[[Any], str | None] = _accepts


def _deepseek_refusal(vllm_config: Any) -> str | None:
    """Why DeepSeek-V2's stream in vLLM would not be HF's here (float16, SP MoE, CPU RoPE)."""
    if str(getattr(vllm_config.model_config, "dtype", "")) == "torch.float16":
        return (
            "DeepseekV2ForCausalLM in float16: vLLM scales its residual stream by "
            "1/routed_scaling_factor against overflow, so the rows would not be the model's "
            "values; use dtype bfloat16 or float32"
        )
    if getattr(vllm_config.parallel_config, "use_sequence_parallel_moe", False):
        return (
            "DeepseekV2ForCausalLM with sequence-parallel MoE (expert + data + tensor "
            "parallel): its layers return each rank's slice of the tokens; turn off "
            "expert parallelism or data parallelism"
        )
    if cpu_rotary_kernel(vllm_config):
        return (
            "DeepseekV2ForCausalLM with plain RoPE on vLLM's CPU build: its in-place rotary "
            "kernel rotates MLA's multi-head query and strided key wrongly, so the model's "
            "values are not HF's; start vLLM with compilation_config={'custom_ops': "
            "['-rotary_embedding']} (PyTorch's rotary op)"
        )
    return None


# Llama-style layers: ``layer(positions, hidden_states, residual) -> (hidden, residual)``.
LLAMA_STYLE = Family("Llama-style (hidden, residual) decoder layers")
# Routed experts inside the layer; the layer's contract is Llama's.
QWEN3_MOE = Family("Qwen3-MoE decoder layers")
# ``layer(hidden_states, positions, residual)``: Llama's contract, arguments reordered.
GPT_OSS = Family("gpt-oss decoder layers (hidden_states first; sliding and full attention)")
# Embeddings scaled by sqrt(hidden) inside ``embed_input_ids``, before layer 0, as in HF.
GEMMA3 = Family("Gemma 3 decoder layers (sliding and full attention, scaled embeddings)")
# MLA attention, dense then MoE layers; Llama's contract, with refusals.
DEEPSEEK_V2 = Family("DeepSeek-V2 (MLA) decoder layers", refusal=_deepseek_refusal)
# Mamba-2, MLP and attention layers, called with keywords; each returns (hidden, residual).
NEMOTRON_H = Family("Nemotron-H hybrid (Mamba-2, MLP, attention) layers")

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA_STYLE,
    "Qwen3ForCausalLM": LLAMA_STYLE,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "GptOssForCausalLM": GPT_OSS,
    "Gemma3ForCausalLM": GEMMA3,
    "DeepseekV2ForCausalLM": DEEPSEEK_V2,
    "NemotronHForCausalLM": NEMOTRON_H,
}


class UnsupportedFamilyError(ValueError):
    """Forward capture does not know how this model passes its residual stream."""


def family_of(architectures: Sequence[str]) -> Family:
    """The adapter for a model's architectures.

    Raises:
        UnsupportedFamilyError: None of them is known; the message names them.
    """
    for arch in architectures:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise UnsupportedFamilyError(
        f"capture='forward' does not support {', '.join(architectures) or 'this model'} yet "
        f"(supported: {', '.join(sorted(FAMILIES))}); the extract engine may capture it: "
        "capture='extract' with vLLM's extract_hidden_states speculative config "
        "(hidden-state serve/extract --capture extract)"
    )


def stream_after(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden, residual)`` of a decoder layer's output; the stream is their sum."""
    if isinstance(output, tuple) and len(output) == 2:
        return output[0], output[1]
    if isinstance(output, torch.Tensor):
        return output, None
    raise RuntimeError(f"forward capture: unexpected decoder layer output {type(output)}")


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def stream_before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The residual stream entering the first decoder layer (the embeddings).

    Found by type, not by position, so every family's argument order works: the
    ``hidden_states`` keyword, else the first floating-point positional argument
    (positions are integers). A second floating-point argument of its shape would be
    a residual, which the first layer never gets.
    """
    floats = [a for a in args if _is_float(a)]
    hidden = kwargs.get("hidden_states", floats[0] if floats else None)
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise RuntimeError("forward capture: the first decoder layer got no embeddings")
    others = [*floats, kwargs.get("residual")]
    if any(_is_float(t) and t is not hidden and t.shape == hidden.shape for t in others):
        raise RuntimeError("forward capture: the first decoder layer got a residual")
    return hidden
