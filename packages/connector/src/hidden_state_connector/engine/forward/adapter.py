"""What forward capture needs from a model family: its decoder layers, how they pass the residual.

A family is listed here only once its values were checked against Hugging Face float32
(tests/connector/test_forward_capture.py). Any other architecture is refused at start-up
by name (``family_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """How one model family's vLLM implementation exposes its residual stream.

    Attributes:
        name: Human name, for messages.
        layers_path: Attribute path from the loaded model to its decoder layer list.
    """

    name: str
    layers_path: str = "model.layers"

    def decoder_layers(self, model: torch.nn.Module) -> Sequence[torch.nn.Module]:
        """The model's decoder layers, in order (all of them: pipeline parallelism is refused)."""
        found: Any = model
        for part in self.layers_path.split("."):
            found = getattr(found, part, None)
            if found is None:
                raise RuntimeError(
                    f"forward capture: {type(model).__name__} has no {self.layers_path} "
                    f"({self.name} adapter)"
                )
        return list(found)


# vLLM's Llama-style layers: ``layer(positions, hidden_states, residual)`` returns
# ``(hidden_states, residual)``; the pre-norm residual stream after the layer is their sum
# (the next layer's fused add-RMSNorm computes exactly that), before the first layer it is
# the embeddings (``hidden_states`` with ``residual`` None).
LLAMA_STYLE = Family("Llama-style (hidden, residual) decoder layers")

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA_STYLE,
    "Qwen3ForCausalLM": LLAMA_STYLE,
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
        f"(supported: {', '.join(sorted(FAMILIES))}); use capture='extract' (the default) "
        "with the extract_hidden_states speculative config"
    )


def stream_after(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden, residual)`` of a decoder layer's output; the stream is their sum."""
    if isinstance(output, tuple) and len(output) == 2:
        return output[0], output[1]
    if isinstance(output, torch.Tensor):
        return output, None
    raise RuntimeError(f"forward capture: unexpected decoder layer output {type(output)}")


def stream_before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The residual stream entering the first decoder layer (the embeddings)."""
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
    if not isinstance(hidden, torch.Tensor) or residual is not None:
        raise RuntimeError("forward capture: the first decoder layer got no embeddings")
    return hidden
