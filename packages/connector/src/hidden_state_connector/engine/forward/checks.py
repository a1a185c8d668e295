"""Start-up checks of forward capture: what it refuses, by name, before vLLM serves.

Refused for now: vLLM's ``extract_hidden_states`` speculative method (the other capture
engine: the two are not combined), speculative decoding under async scheduling (a step's
positions depend on the previous step's acceptance, which the scheduler half learns only
after it scheduled the step), prefix caching where held prefix rows cannot follow
vLLM's blocks (a block size that is not a multiple of the arena's, a recurrent state),
pipeline parallelism with prefix caching or a drafter (not run together yet; without
them each stage captures its layers, ``stages``), models with no full-attention KV-cache
group (rows are routed by a block table that holds every token), families the adapter
does not know, and settings a known family refuses (``Family.refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.capture import num_hidden_layers
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.adapter import family_of
from hidden_state_connector.engine.forward.arena import ARENA_BLOCK_TOKENS
from hidden_state_connector.engine.output_tokens import NO_ASYNC_FLAG, async_scheduling

EXTRACT_METHOD = "extract_hidden_states"
"""vLLM's speculative method that the extract engine (``capture: "extract"``) runs on."""


class ForwardCaptureError(ValueError):
    """The engine's settings or model cannot be captured with ``capture='forward'``."""


@dataclass(frozen=True)
class ForwardSetup:
    """What the facade needs to build either half of a forward-capture connector.

    Attributes:
        layer_ids: Captured layer ids, ascending, without repeats.
        group: The attention KV-cache group whose slot mapping routes rows.
        block_size: That group's block size.
        slot_layer: One attention layer of that group ("" when vLLM gave no cache config).
    """

    layer_ids: list[int]
    group: int
    block_size: int
    slot_layer: str


def forward_setup(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> ForwardSetup:
    """Check the engine for forward capture and describe what it captures.

    Raises:
        ForwardCaptureError: A setting or the model is not supported; the message names it.
    """
    where = "HiddenStateConnector (capture='forward')"
    speculation = speculation_refusal(vllm_config)
    if speculation is not None:
        raise ForwardCaptureError(f"{where}: {speculation}")
    _check_prefix_caching(vllm_config, where)
    _check_pipeline(vllm_config, where)
    model_config = vllm_config.model_config
    architectures = list(getattr(model_config, "architectures", None) or [])
    model_name = "/".join(architectures) or "this model"
    try:
        family = family_of(architectures)
    except ValueError as exc:
        raise ForwardCaptureError(f"{where}: {exc}") from None
    reason = family.refusal(vllm_config)
    if reason is not None:
        raise ForwardCaptureError(f"{where}: {reason}")
    n = num_hidden_layers(model_config)
    assert config.layer_ids is not None  # ConnectorConfig checks it for capture='forward'
    if n is not None and not all(0 <= i <= n for i in config.layer_ids):
        raise ForwardCaptureError(
            f"{where}: layer_ids {list(config.layer_ids)}: the model has {n} layers, so layer "
            f"ids run from 0 (embeddings) to {n} (the last layer's output, before the norm)"
        )
    group, layer = _routing_group(kv_cache_config, f"{where}: {model_name}")
    block_size = compat.hidden_state_block_size(vllm_config, kv_cache_config, group)
    layer_ids = compat.captured_layer_ids(config.layer_ids)
    return ForwardSetup(layer_ids, group, block_size, layer)


def speculation_refusal(vllm_config: Any) -> str | None:
    """Why forward capture cannot run beside this engine's drafter (None: it can, or none).

    Any drafting method runs beside it (ngram, EAGLE/EAGLE-3, MTP, a draft model): the
    hooks sit on the target model's decoder layers only, and the rows of rejected drafts
    are recomputed at the same positions in the next step. Refused: the
    ``extract_hidden_states`` method (the extract engine's; its layers come from
    ``layer_ids`` here), and speculation under async scheduling.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if method == EXTRACT_METHOD:
        return (
            f"speculative_config method {EXTRACT_METHOD!r} is the extract engine's "
            "(capture='extract'); with capture='forward' remove it (the layers come from "
            "kv_connector_extra_config.layer_ids), or use capture='extract'"
        )
    if async_scheduling(vllm_config):
        return (
            f"speculative_config method {method!r} under vLLM's async scheduling is not "
            "supported yet (a step's token positions depend on the previous step's accepted "
            "drafts, which the connector learns only after that step is scheduled); start "
            f"vLLM with {NO_ASYNC_FLAG} (LLM(async_scheduling=False))"
        )
    return None


def _check_prefix_caching(vllm_config: Any, where: str) -> None:
    """Refuse prefix caching where held prefix rows cannot follow vLLM's cached blocks."""
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, "enable_prefix_caching", False):
        return
    off = "or start vLLM with --no-enable-prefix-caching (enable_prefix_caching=False)"
    block = int(cache_config.block_size)
    if block % ARENA_BLOCK_TOKENS:
        raise ForwardCaptureError(
            f"{where}: with prefix caching, block_size must be a multiple of "
            f"{ARENA_BLOCK_TOKENS} (rows of cached blocks are held in blocks of that many "
            f"tokens), got {block}: set --block-size {ARENA_BLOCK_TOKENS}, {off}"
        )
    if getattr(vllm_config.model_config, "has_inner_state", False):
        raise ForwardCaptureError(
            f"{where}: prefix caching with a recurrent-state (Mamba / linear-attention) "
            f"model is not supported yet; {off}"
        )


def _check_pipeline(vllm_config: Any, where: str) -> None:
    """Refuse what pipeline parallelism was not run with: prefix caching, a drafter."""
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) <= 1:
        return
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ForwardCaptureError(
            f"{where}: pipeline parallelism with prefix caching is not supported yet (the "
            "two were not run together). Start vLLM with --no-enable-prefix-caching "
            "(enable_prefix_caching=False), or use pipeline_parallel_size=1."
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ForwardCaptureError(
            f"{where}: pipeline parallelism with a speculative_config is not supported yet "
            "(the two were not run together); remove speculative_config, or use "
            "pipeline_parallel_size=1."
        )


def _routing_group(kv_cache_config: Any, where: str) -> tuple[int, str]:
    """The KV-cache group rows are routed through and one of its layers (``compat``)."""
    if kv_cache_config is None:
        return 0, ""
    try:
        return compat.attention_group(kv_cache_config)
    except ValueError as exc:
        raise ForwardCaptureError(f"{where}: {exc}") from None


def check_model_before_start(model: str, where: str) -> None:
    """Forward capture's family check of a model folder or hub id, before vLLM starts.

    Reads the model's ``config.json`` (a folder's, or a hub model's from the Hugging Face
    cache); when there is none, vLLM will say what is wrong, so nothing is refused here.

    Raises:
        ForwardCaptureError: No architecture of the model is a known family.
    """
    from hidden_state_connector.model_config import ModelConfigError, read_model_config

    try:
        config = read_model_config(model, hub="cache")
    except ModelConfigError:
        return
    architectures = [str(a) for a in config.get("architectures") or []]
    if not architectures:
        return  # nothing named: vLLM will say what it makes of the model
    try:
        family_of(architectures)
    except ValueError as exc:
        raise ForwardCaptureError(f"{where}: {exc}") from None
