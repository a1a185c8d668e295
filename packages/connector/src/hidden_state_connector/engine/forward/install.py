"""Install the capture while vLLM builds the model, before anything compiles it.

vLLM compiles the model (``torch.compile``, then CUDA graphs) during its memory profile,
before the connector exists, and the compiled code never calls hooks added later. So the
connector's plugin (``hidden_state_connector.plugin``, loaded by vLLM in every process)
watches module registration: when a model under construction whose engine asks for
``capture: "forward"`` registers its decoder layer list, the staging buffer is built and
the layers hooked right there: the target model's (built first, as long as its
``num_hidden_layers``); a drafter's own layers (EAGLE, MTP, a draft model) are never
hooked. The worker half picks the staging up with
``staging_for(vllm_config)``. The first module registered for an engine whose
connector is this one (either capture engine) runs the start-up refusals
(``engine.engines.refuse_unsupported``) before the weights load. Other engines are left untouched.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.staging import StepStaging, installed, staging_for
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

_LAYER_LIST_NAME = "layers"
COMPILE_CACHE_KEY = "hidden_state_connector"
"""The ``additional_config`` entry that keys compiled code with the capture apart."""
_hook_handle: Any = None
# The engine configuration checked last, and its connector settings (capture chosen).
_checked: tuple[weakref.ref[Any], ConnectorConfig] | None = None


def watch_model_construction() -> None:
    """Start watching module registration in this process (idempotent, cheap)."""
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = torch.nn.modules.module.register_module_module_registration_hook(
            _on_module_registered
        )


def _on_module_registered(parent: torch.nn.Module, name: str, module: Any) -> None:
    """Registration hook: check an engine of ours early; hook a forward-capture model's layers.

    The first module vLLM registers for an engine whose connector is this one runs the
    start-up refusals (``engines.refuse_unsupported``), so a refused model stops before its weights
    load; their error leaves the model's construction on purpose.
    """
    vllm_config = _our_engine()
    if vllm_config is None:
        return None
    from hidden_state_connector.engine.engines import hooks_model

    config = _checked_config(vllm_config)
    if name != _LAYER_LIST_NAME or not isinstance(module, torch.nn.ModuleList) or not module:
        return None
    if not hooks_model(config):
        return None
    try:
        _install(module, vllm_config, config)
    except Exception as exc:  # never break model construction; the worker refuses later
        log.warning("forward capture: hooks not installed (%s: %s)", type(exc).__name__, exc)
    return None


def _checked_config(vllm_config: Any) -> ConnectorConfig:
    """The engine's connector settings, capture chosen; checked once per engine."""
    global _checked
    if _checked is not None and _checked[0]() is vllm_config:
        return _checked[1]
    from hidden_state_connector.engine.engines import choose_capture, refuse_unsupported

    config = choose_capture(ConnectorConfig.from_extra_config(_extra(vllm_config)), vllm_config)
    refuse_unsupported(vllm_config, config)
    try:
        _checked = (weakref.ref(vllm_config), config)
    except TypeError:  # not weakly referable: checked each time (cheap, and it raises once)
        _checked = None
    return config


def _install(layers: torch.nn.ModuleList, vllm_config: Any, config: ConnectorConfig) -> None:
    if staging_for(vllm_config) is not None:
        return
    from hidden_state_connector.engine import compat
    from hidden_state_connector.engine.capture import num_hidden_layers
    from hidden_state_connector.engine.forward.adapter import UnsupportedFamilyError, family_of
    from hidden_state_connector.engine.forward.stages import stage_plan

    model_config = vllm_config.model_config
    try:
        family = family_of(list(getattr(model_config, "architectures", None) or []))
    except UnsupportedFamilyError:
        return  # refused by name when the connector starts
    if not _is_decoder_list(layers, family.layers_path):
        return
    n = num_hidden_layers(model_config)
    if n is not None and len(layers) != n:
        return  # a drafter's own decoder layers (EAGLE, MTP): never captured
    if compat.tensor_parallel_rank() != 0:  # the states are replicated; rank 0 captures them
        return
    layer_ids = compat.captured_layer_ids(list(config.layer_ids or ()))
    if any(i > len(layers) for i in layer_ids):
        return  # the connector's start-up check names the bad ids
    stage = stage_plan(layer_ids, len(layers))  # under PP: this stage's layers only
    staging = StepStaging(
        stage.ids_of(stage.stage),
        int(vllm_config.scheduler_config.max_num_batched_tokens),
        int(model_config.get_hidden_size()),
        model_config.dtype,
        torch.get_default_device(),
    )
    staging.install(list(layers))
    # The hooks keep it alive, and the model keeps it where no hook does (a pipeline stage
    # that computes none of the ids): ``_installed`` holds it weakly.
    layers.__dict__["hidden_state_staging"] = staging
    installed(vllm_config, staging)
    key_compile_cache(vllm_config, layer_ids)


def key_compile_cache(vllm_config: Any, layer_ids: list[int]) -> None:
    """Give compiled code with the capture a compile-cache key of its own.

    vLLM keys its compile cache (and loads compiled code without tracing) by a hash of its
    config that leaves ``kv_transfer_config`` out: a model compiled once without the capture
    would be loaded without it, and every row would stay zero (seen on an H100 with vLLM
    0.26). ``additional_config`` is in that hash, so the capture is recorded there.
    """
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        extra[COMPILE_CACHE_KEY] = {"capture": "forward", "layer_ids": list(layer_ids)}
    else:
        log.warning(
            "forward capture: additional_config is not a dict; if this model was compiled "
            "before without the capture, set VLLM_DISABLE_COMPILE_CACHE=1"
        )


def _our_engine() -> Any:
    """The vLLM config being built, if its connector is this one (either capture engine)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    vllm_config = get_current_vllm_config_or_none()
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return None
    from hidden_state_connector import CONNECTOR_NAME

    return vllm_config if transfer.kv_connector == CONNECTOR_NAME else None


def _extra(vllm_config: Any) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _is_decoder_list(layers: torch.nn.ModuleList, layers_path: str) -> bool:
    """Whether this list is the language model's decoder layers (not a vision tower's).

    vLLM names each attention layer by its path in the model (``model.layers.3.self_attn.
    attn``): the list is the family's ``layers_path`` when its layers' names say so.
    """
    prefix = f"{layers_path}."
    for sub in layers.modules():
        name = getattr(sub, "layer_name", None)
        if isinstance(name, str):
            return name.startswith(prefix)
    return False
