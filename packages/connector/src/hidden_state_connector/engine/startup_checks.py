"""The refusals that need only the engine's configuration, run before vLLM loads the model.

vLLM builds and loads the model before any connector exists, and some models fail in
vLLM after their weights load with an error that names neither the model nor what works
(the AMX MLA backend with float32 weights, ``engine.cpu_build``). So the connector's
plugin runs these checks at the first module vLLM registers for an engine whose
connector is this one (``engine.forward.install``): a refused engine stops before its
weights are read. The connector runs them again when it starts, for processes where the
plugin was not loaded.
"""

from __future__ import annotations

from typing import Any

from hidden_state_connector.engine import architecture, compat, output_tokens
from hidden_state_connector.engine.config import CAPTURE_FORWARD, ConnectorConfig
from hidden_state_connector.engine.cpu_build import amx_mla_dtype_refusal


def refuse_unsupported(vllm_config: Any, config: ConnectorConfig) -> None:
    """Refuse, by name, an engine whose model or settings its capture engine cannot capture.

    The capture engine's own refusals first (they are final), then the CPU build's
    choices that a change of dtype or backend avoids.

    Raises:
        ValueError: ``ForwardCaptureError`` or ``UnsupportedArchitectureError`` (both
            ``ValueError``); the message names the setting or the model and what works.
    """
    if config.capture == CAPTURE_FORWARD:
        from hidden_state_connector.engine.forward.checks import forward_setup

        forward_setup(vllm_config, None, config)
    else:
        architecture.check_engine_model(
            vllm_config, compat.vllm_version(), config.include_output_tokens
        )
        output_tokens.check_output_tokens_default(vllm_config, config.include_output_tokens)
    reason = amx_mla_dtype_refusal(vllm_config)
    if reason is not None:
        raise architecture.UnsupportedArchitectureError(f"HiddenStateConnector: {reason}")
