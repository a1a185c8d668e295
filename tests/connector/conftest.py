"""Fixtures for tests that run real vLLM (the CPU build here) with the connector."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from procs import IN_PROCESS_ENGINE, VLLM_MISSING

# Keep vLLM quiet and local.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without vLLM these files are not collected (most of them need it).
collect_ignore_glob = ["*.py"] if VLLM_MISSING else []


class HFReference:
    """HF transformers' hidden states for the same weights: the golden values."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers = len(self.model.model.layers)
        self._last: torch.Tensor | None = None

        def keep_last(_module: object, _inputs: object, output: object) -> None:
            self._last = output[0] if isinstance(output, tuple) else output  # type: ignore[assignment]

        self.model.model.layers[-1].register_forward_hook(keep_last)

    @torch.no_grad()
    def layer(self, token_ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Layer id k: output of decoder layer k-1 (0 = embeddings, N = last, pre-norm)."""
        out = self.model(token_ids[None].long(), output_hidden_states=True)
        if layer_id == self.num_layers:
            assert self._last is not None
            return self._last[0]
        return out.hidden_states[layer_id][0]


@pytest.fixture(scope="session")
def hf_fp32(tiny_model_fp32: Path) -> HFReference:
    return HFReference(tiny_model_fp32)


def assert_matches_reference(sample: object, ref: HFReference, rtol: float = 1e-4) -> None:
    """Every captured layer of a sample equals HF's value for the same tokens."""
    token_ids = sample.token_ids  # type: ignore[attr-defined]
    assert sample.layer_ids, "writer must record layer_ids"  # type: ignore[attr-defined]
    for pos, layer_id in enumerate(sample.layer_ids):  # type: ignore[attr-defined]
        expected = ref.layer(token_ids, layer_id)
        got = sample.hidden_states[:, pos].float()  # type: ignore[attr-defined]
        err = ((got - expected).norm() / expected.norm()).item()
        assert err < rtol, f"{sample.path} layer {layer_id}: relative error {err:.2e}"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """A module's engines in this process (see procs.IN_PROCESS_ENGINE)."""
    env = pytest.MonkeyPatch()
    for key, value in IN_PROCESS_ENGINE.items():
        env.setenv(key, value)
    yield
    env.undo()
