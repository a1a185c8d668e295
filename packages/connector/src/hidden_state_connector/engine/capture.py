"""What an engine's capture is: the metadata every sample it writes shares.

Each file records the model (name or path, revision, number of decoder layers), the
captured layer ids and the vLLM that computed them, so a trainer can check that the data
is what it thinks: ``hidden-state export --format speculators`` refuses a capture whose
last layer is not the model's last (``SampleHeader.captures_last_layer``). The keys are
``hidden_state_reader.format.Meta``'s; ``model_dtype`` is recorded by the file writer.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hidden_state_reader.format import sample_metadata

# A Hugging Face cache snapshot: .../models--ORG--NAME/snapshots/<commit hash>[/...]
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Capture:
    """The fields of a capture that every sample of one engine shares.

    Attributes:
        model: The served model (path or name), as vLLM was given it.
        layer_ids: Captured layer ids, in layer-axis order.
        num_hidden_layers: The model's decoder layers (None when vLLM does not say).
        model_revision: Commit hash of the weights when known, else the revision asked
            for (None: neither).
        vllm_version: The running vLLM's version.
        producer: ``hidden-state-connector/<version> vllm/<version>``.
    """

    model: str
    layer_ids: tuple[int, ...]
    num_hidden_layers: int | None
    model_revision: str | None
    vllm_version: str
    producer: str

    def metadata(self, *, request_id: str, num_prompt_tokens: int) -> dict[str, str]:
        """One sample's ``__metadata__`` map."""
        return sample_metadata(
            layer_ids=self.layer_ids,
            model=self.model,
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            producer=self.producer,
            num_hidden_layers=self.num_hidden_layers,
            model_revision=self.model_revision,
            vllm_version=self.vllm_version,
        )


def describe_capture(
    vllm_config: Any, layer_ids: Sequence[int], *, connector_version: str, vllm_version: str
) -> Capture:
    """What ``vllm_config``'s engine captures, read from its model config.

    Raises:
        ValueError: A captured layer id is outside ``0..num_hidden_layers`` (vLLM would
            never fill that layer).
    """
    model_config = getattr(vllm_config, "model_config", None)
    n = num_hidden_layers(model_config)
    if n is not None and not all(0 <= i <= n for i in layer_ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(layer_ids)}: the model has {n} layers, "
            f"so layer ids run from 0 (embeddings) to {n} (the last layer's output)"
        )
    return Capture(
        model=str(getattr(model_config, "model", "") or ""),
        layer_ids=tuple(layer_ids),
        num_hidden_layers=n,
        model_revision=model_revision(model_config),
        vllm_version=vllm_version,
        producer=f"hidden-state-connector/{connector_version} vllm/{vllm_version}",
    )


def num_hidden_layers(model_config: Any) -> int | None:
    """The model's decoder layer count (all pipeline stages), or None if unknown.

    ``ModelConfig.get_total_num_hidden_layers()`` (vLLM >= 0.10; it knows the
    architectures that name the count differently), else the text config's
    ``num_hidden_layers`` (multimodal models keep it there).
    """
    getter = getattr(model_config, "get_total_num_hidden_layers", None)
    value: Any = None
    if callable(getter):
        try:
            value = getter()
        except Exception:  # an architecture vLLM cannot describe: fall back
            value = None
    if value is None:
        for attr in ("hf_text_config", "hf_config"):
            value = getattr(getattr(model_config, attr, None), "num_hidden_layers", None)
            if value is not None:
                break
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def model_revision(model_config: Any) -> str | None:
    """The commit hash of the model's weights when known, else the revision asked for.

    In order: the hash vLLM resolved the revision to (``huggingface_hub``'s
    ``ResolvedRevision.resolved``), the hash ``transformers`` recorded on the config it
    loaded (``_commit_hash``), the hash in a Hugging Face cache snapshot path
    (``.../snapshots/<hash>``), then the revision string itself (a tag or branch).
    """
    revision = getattr(model_config, "revision", None)
    resolved = getattr(revision, "resolved", None)
    if isinstance(resolved, str) and resolved:
        return resolved
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    if isinstance(commit, str) and _COMMIT.match(commit):
        return commit
    model = str(getattr(model_config, "model", "") or "")
    if model and os.path.isdir(model):
        match = _SNAPSHOT.search(os.path.realpath(model).replace(os.sep, "/"))
        if match is None:
            match = _SNAPSHOT.search(os.path.abspath(model).replace(os.sep, "/"))
        if match is not None:
            return match.group(1)
    if isinstance(revision, str) and revision:
        return str(revision)
    return None
