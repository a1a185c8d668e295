"""What the extract engine can capture, and where its rows live in vLLM's cache.

The refusals name the model or setting and what works (``architecture``: MLA, models
without the aux-hidden-state interface, a recurrent state with prefix caching or
generated tokens; ``output_tokens``: generated tokens under async scheduling by
default). The set-up is the hidden-state KV-cache group and its layers, in the order
vLLM captures them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hidden_state_connector.engine import architecture, compat, output_tokens
from hidden_state_connector.engine.config import ConnectorConfig


@dataclass(frozen=True)
class ExtractSetup:
    """What the factory needs to build either half of an extract connector.

    Attributes:
        group: Index of the hidden-state KV-cache group.
        block_size: That group's block size.
        configured: Layer ids as configured (``eagle_aux_hidden_state_layer_ids``).
        layer_ids: Layer ids as captured, in layer-axis order.
    """

    group: int
    block_size: int
    configured: list[int]
    layer_ids: list[int]


def refuse_unsupported(vllm_config: Any, config: ConnectorConfig) -> None:
    """Refuse, by name, an engine whose model or settings extract cannot capture.

    Raises:
        ValueError: ``UnsupportedArchitectureError``, or generated tokens refused.
    """
    architecture.check_engine_model(
        vllm_config, compat.vllm_version(), config.include_output_tokens
    )
    output_tokens.check_output_tokens_default(vllm_config, config.include_output_tokens)


def extract_setup(vllm_config: Any, kv_cache_config: Any) -> ExtractSetup:
    """The hidden-state cache group of this engine, its block size and layers."""
    group = compat.hidden_state_group(kv_cache_config)
    block_size = compat.hidden_state_block_size(vllm_config, kv_cache_config, group)
    configured = compat.configured_layer_ids(vllm_config)
    return ExtractSetup(group, block_size, configured, compat.captured_layer_ids(configured))
