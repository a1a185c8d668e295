"""What captured samples are checked against: Hugging Face's float32 residual stream.

Shared by the engine tests that compare vLLM's captured rows with transformers (the
extract engine's architectures, forward capture): layer id k is the output of decoder
layer k-1 before the final norm (``output_hidden_states[k]``; the last layer through a
hook, since transformers applies the norm to its last entry).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hidden_state_reader import HiddenStateReader, Sample


def read_one(path: str) -> Sample:
    """The one sample at ``path``, CRC checked (waits for its writer)."""
    root, name = os.path.split(path)
    samples = list(HiddenStateReader(root, names=[name], on_error="raise", verify_checksum=True))
    assert len(samples) == 1
    return samples[0]


class Reference:
    """A tiny model's float32 hidden states in transformers, per captured layer id.

    Args:
        model_dir: The model folder (``build_tiny_model``).
        num_layers: Its decoder layers (id ``num_layers`` is the last, before the norm).
    """

    def __init__(self, model_dir: Path, num_layers: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers = num_layers
        self.last: torch.Tensor | None = None
        self.model.model.layers[-1].register_forward_hook(self._keep_last)

    def _keep_last(self, _module: object, _inputs: object, output: object) -> None:
        self.last = output[0] if isinstance(output, tuple) else output  # type: ignore[assignment]

    @torch.no_grad()
    def layer_errors(self, sample: Sample) -> dict[int, float]:
        """Relative error of each captured layer against transformers' values."""
        out = self.model(sample.token_ids[None].long(), output_hidden_states=True)
        errors = {}
        for pos, layer_id in enumerate(sample.layer_ids or []):
            assert self.last is not None
            last = layer_id == self.num_layers
            expected = self.last[0] if last else out.hidden_states[layer_id][0]
            got = sample.hidden_states[:, pos].float()
            errors[layer_id] = ((got - expected).norm() / expected.norm()).item()
        return errors
