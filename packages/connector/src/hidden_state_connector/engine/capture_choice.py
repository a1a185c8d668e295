"""Which capture engine an engine runs, and its layers: the one reader of ``capture``.

Forward capture is the default: a connector config with no ``capture`` key runs it,
unless the engine runs vLLM's ``extract_hidden_states`` speculative method, which only
the extract engine uses (the configs written before forward capture existed keep their
engine). ``capture: "extract"`` or ``"forward"`` chooses explicitly. Forward capture with
no ``layer_ids`` captures EAGLE-3's layers and the last one, ``[2, N/2, N-3, N]`` (what
speculators' and SpecForge's EAGLE-3 trainers read: three auxiliary layers and the
verifier's last hidden state, before the final norm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hidden_state_connector.engine.capture import num_hidden_layers
from hidden_state_connector.engine.config import CAPTURE_EXTRACT, CAPTURE_FORWARD, ConnectorConfig
from hidden_state_connector.layers import default_layer_ids

EXTRACT_METHOD = "extract_hidden_states"


def speculative_method(vllm_config: Any) -> str | None:
    """The engine's speculative method (None: no speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else getattr(spec, "method", None)


def default_forward_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three auxiliary layers and the last one (pre-norm)."""
    return tuple(sorted({*default_layer_ids(num_layers), num_layers}))


def choose_capture(config: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """``config`` with its capture engine and (forward) its layer ids decided.

    Raises:
        ValueError: Forward capture with no ``layer_ids`` of a model whose layer count
            vLLM does not give; the message names the key.
    """
    capture = config.capture
    if capture is None:
        extract = speculative_method(vllm_config) == EXTRACT_METHOD
        capture = CAPTURE_EXTRACT if extract else CAPTURE_FORWARD
    layer_ids = config.layer_ids
    if capture == CAPTURE_EXTRACT and layer_ids is not None:
        raise ValueError(
            "layer_ids: only for forward capture; the extract engine takes its layers from "
            "speculative_config (eagle_aux_hidden_state_layer_ids)"
        )
    if capture == CAPTURE_FORWARD and not layer_ids:
        n = num_hidden_layers(vllm_config.model_config)
        if not n:
            raise ValueError(
                "layer_ids: this model's number of layers is unknown, so forward capture has "
                "no default layers; set kv_connector_extra_config.layer_ids (e.g. [2, 16, 29])"
            )
        layer_ids = default_forward_layers(n)
    return dataclasses.replace(config, capture=capture, layer_ids=layer_ids)
