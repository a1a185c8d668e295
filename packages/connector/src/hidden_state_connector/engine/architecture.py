"""Which model architectures the installed vLLM can capture hidden states of.

``extract_hidden_states`` needs the verifier's model class to have vLLM's aux-hidden-state
interface (``SupportsEagle3``); without it vLLM fails at start-up with a message that
names neither the model nor what works. And an MLA verifier (DeepSeek-V2/V3, Kimi, ...)
is refused. vLLM's CPU build turns chunked prefill off for MLA, while
``extract_hidden_states`` caps each step's token budget at ``max_num_batched_tokens``:
a prompt longer than that is never scheduled and ``generate()`` never returns. And the
hidden-state cache layer is merged into the MLA layers' KV-cache group
(``HiddenStateCacheSpec`` subclasses ``MLAAttentionSpec``, whose ``merge`` does not
compare head sizes), sharing their block table; vLLM 0.34's own example connector
refuses MLA verifiers for that reason. Models with a recurrent state (Mamba / linear-attention
hybrids) are captured right for their prompt only, and without prefix caching
(``recurrent_state_refusal``, ``check_engine_model``).

The capturing architectures are read from the installed vLLM's source files (its model
registry and the classes that declare ``SupportsEagle3``, directly or through a base),
without importing vLLM: ``hidden-state serve`` / ``extract`` check a model before they
start vLLM, and the connector checks it again inside the engine.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Sequence
from typing import Any

from hidden_state_connector.model_config import ModelConfigError, read_model_config

INTERFACE = "SupportsEagle3"
_REGISTRY_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")
_ENTRY = re.compile(r'"(\w+)"\s*:\s*\(\s*"(\w+)"\s*,\s*"(\w+)"\s*,?\s*\)')
_CLASS = re.compile(r"^class\s+(\w+)\s*\(([^)]*)\)\s*:", re.MULTILINE)
_MLA = re.compile(r"\bkv_lora_rank\b")  # what ``uses_mla`` looks for in a model's config
_WORD = re.compile(r"\w+")


class UnsupportedArchitectureError(ValueError):
    """The installed vLLM cannot capture this model's hidden states."""


def _models_dir() -> str | None:
    """``vllm/model_executor/models`` of the installed vLLM (None if not found)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = next(iter(spec.submodule_search_locations))
    path = os.path.join(package, "model_executor", "models")
    return path if os.path.isdir(path) else None


def _registry_entries(source: str) -> dict[str, tuple[str, str]]:
    """Architecture -> (module, class) from the registry's text and multimodal tables."""
    entries: dict[str, tuple[str, str]] = {}
    for table in _REGISTRY_TABLES:
        start = source.find(f"\n{table} = {{")
        if start < 0:
            continue
        end = source.find("\n}", start)
        for arch, module, cls in _ENTRY.findall(source[start:end]):
            entries[arch] = (module, cls)
    return entries


def _module_texts(models_dir: str, modules: set[str]) -> dict[str, str]:
    """The source of each model module that can be read."""
    texts = {}
    for module in modules:
        try:
            with open(os.path.join(models_dir, f"{module}.py"), encoding="utf-8") as f:
                texts[module] = f.read()
        except OSError:
            continue
    return texts


def _subclasses(bases: dict[str, set[str]], roots: set[str]) -> set[str]:
    """``roots`` and every class deriving from one of them (by name), transitively."""
    found = set(roots)
    grew = True
    while grew:
        more = {name for name, names in bases.items() if names & found}
        grew = not more <= found
        found |= more
    return found


def _class_bases(texts: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, str]]:
    """(Class name -> base names, class name -> its module), from the modules' text."""
    bases: dict[str, set[str]] = {}
    module_of: dict[str, str] = {}
    for module, text in texts.items():
        for name, listed in _CLASS.findall(text):
            module_of.setdefault(name, module)
            bases.setdefault(name, set()).update(
                b.strip().split("[")[0].split(".")[-1] for b in listed.split(",") if b.strip()
            )
    return bases, module_of


def _latent_classes(
    texts: dict[str, str], bases: dict[str, set[str]], module_of: dict[str, str]
) -> set[str]:
    """Classes that may run with MLA (by name).

    Those defined in a module that reads ``kv_lora_rank``, deriving from one, or in a
    module that names one (a wrapper that builds its language model by name).
    """
    reads_rank = {m for m, t in texts.items() if _MLA.search(t)}
    latent = _subclasses(bases, {c for c, m in module_of.items() if m in reads_rank})
    # One pass over each text: a search per class and text cost seconds of CPU in every
    # process that checks a model (each launcher, each engine's connector).
    named = {m for m, t in texts.items() if not latent.isdisjoint(_WORD.findall(t))}
    return _subclasses(bases, latent | {c for c, m in module_of.items() if m in named})


@functools.lru_cache(maxsize=1)
def _registry() -> tuple[frozenset[str], frozenset[str], frozenset[str]] | None:
    """The installed vLLM's architectures: (all, with the interface, of those with MLA).

    "With MLA": may run with it (``_latent_classes``); serve decides by the config.
    """
    models_dir = _models_dir()
    if models_dir is None:
        return None
    try:
        with open(os.path.join(models_dir, "registry.py"), encoding="utf-8") as f:
            entries = _registry_entries(f.read())
    except OSError:
        return None
    if not entries:
        return None
    texts = _module_texts(models_dir, {module for module, _ in entries.values()})
    bases, module_of = _class_bases(texts)
    capturing = _subclasses(bases, {INTERFACE}) - {INTERFACE}
    latent = _latent_classes(texts, bases, module_of)
    known = frozenset(arch for arch, (_, cls) in entries.items() if cls in capturing)
    mla = frozenset(arch for arch in known if entries[arch][1] in latent)
    return frozenset(entries), known, mla


def capturing_architectures() -> frozenset[str] | None:
    """Architectures of the installed vLLM whose model class has ``SupportsEagle3``.

    None when vLLM's sources cannot be read (then nothing is refused on this ground).
    """
    registry = _registry()
    return None if registry is None else registry[1]


def uses_mla(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (or its ``text_config``) describes latent attention (MLA).

    vLLM runs a model with MLA when its config has ``kv_lora_rank`` (and
    ``VLLM_MLA_DISABLE`` is not set).
    """
    text_config = config.get("text_config") or {}
    rank = config.get("kv_lora_rank", text_config.get("kv_lora_rank"))
    return rank is not None and os.environ.get("VLLM_MLA_DISABLE", "0") in ("", "0")


def _families(architectures: frozenset[str]) -> str:
    """Architecture names without their head suffix, for a readable list."""
    suffix = re.compile(r"(ForCausalLM|ForConditionalGeneration|Generation)$")
    return ", ".join(sorted({suffix.sub("", a) or a for a in architectures}))


def capturable_families() -> str | None:
    """The families the installed vLLM can capture, as the refusals list them.

    Families whose model may run with MLA (their module reads ``kv_lora_rank``: DeepSeek
    V2/V3 and what builds on them) are listed apart: with ``kv_lora_rank`` in the config
    they are refused as MLA (``check_capturable``) unless ``VLLM_MLA_DISABLE=1``. None
    when vLLM's sources cannot be read.
    """
    registry = _registry()
    if registry is None:
        return None
    _, known, mla = registry
    plain = _families(known - mla)
    if not mla:
        return plain
    return (
        f"{plain}; and, when their config has no kv_lora_rank (no MLA) or with "
        f"VLLM_MLA_DISABLE=1, {_families(mla)}"
    )


def check_capturable(
    architectures: Sequence[str], *, mla: bool, vllm_version: str, where: str
) -> None:
    """Refuse a model whose hidden states the installed vLLM cannot capture.

    Args:
        architectures: The model's ``architectures`` (``config.json``).
        mla: The model runs with multi-head latent attention in vLLM.
        vllm_version: The installed vLLM release (for the message).
        where: Who refuses (``HiddenStateConnector``, ``hidden-state serve``, ...).

    Raises:
        UnsupportedArchitectureError: MLA, or no architecture with the interface.
    """
    name = "/".join(architectures) or "this model"
    if mla:
        raise UnsupportedArchitectureError(
            f"{where}: {name} uses multi-head latent attention (MLA); vLLM {vllm_version} "
            "cannot capture its hidden states (its hidden-state cache layer is merged into "
            "the MLA layers' KV-cache group, and on the CPU build a prompt longer than "
            "max_num_batched_tokens is never scheduled: generate() hangs). Not supported: "
            "capture a model without MLA, or run vLLM with VLLM_MLA_DISABLE=1 (plain "
            "attention; its values are not checked by this project's tests)."
        )
    registry = _registry()
    if registry is None:
        return
    implemented, known, _ = registry
    # Architectures vLLM does not implement itself (plugins, the Transformers backend)
    # are left to vLLM to judge.
    if not any(a in implemented for a in architectures) or any(a in known for a in architectures):
        return
    raise UnsupportedArchitectureError(
        f"{where}: vLLM {vllm_version} cannot capture the hidden states of {name}: its "
        f"model class lacks vLLM's aux-hidden-state interface ({INTERFACE}), which "
        "extract_hidden_states needs. Model families this vLLM can capture: "
        f"{capturable_families()}. Capture one of those, or install a vLLM release whose "
        f"{name} supports EAGLE-3."
    )


def recurrent_state_refusal(vllm_config: Any) -> str | None:
    """Why generated tokens cannot be captured for this engine's model, or None.

    Models with a recurrent state (Mamba and linear-attention hybrids such as Nemotron-H)
    are captured right for the prompt only: vLLM 0.32's extraction step advances the
    state for its speculative slot, and every row after the prompt is wrong (docs/connector.md,
    "Support matrix").
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not getattr(model_config, "has_inner_state", False):
        return None
    name = "/".join(getattr(model_config, "architectures", None) or []) or "this model"
    return (
        f"{name} keeps a recurrent (Mamba / linear-attention) state: vLLM captures its "
        "prompt right but not its generated tokens; include_output_tokens is refused"
    )


def check_engine_model(vllm_config: Any, vllm_version: str, include_output_tokens: bool) -> None:
    """``check_capturable`` for the model of a running engine (the connector's check).

    Also refuses, for models with a recurrent state, prefix caching (vLLM 0.32's CPU
    build crashes at the first request) and ``include_output_tokens`` by default.

    Raises:
        UnsupportedArchitectureError: See ``check_capturable``, or the above.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    architectures = list(getattr(model_config, "architectures", None) or [])
    where = "HiddenStateConnector"
    check_capturable(
        architectures,
        mla=bool(getattr(model_config, "use_mla", False)),
        vllm_version=vllm_version,
        where=where,
    )
    recurrent = recurrent_state_refusal(vllm_config)
    if recurrent is None:
        return
    if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
        raise UnsupportedArchitectureError(
            f"{where}: {recurrent.split(':')[0]}; with prefix caching vLLM {vllm_version} "
            "fails at the first request when it captures hidden states. Start vLLM with "
            "prefix caching off (--no-enable-prefix-caching, enable_prefix_caching=False)."
        )
    if include_output_tokens:
        raise UnsupportedArchitectureError(
            f"{where}: {recurrent} (kv_connector_extra_config.include_output_tokens is "
            "true: set it to false)."
        )


def _cached_config(model: str) -> dict[str, Any] | None:
    """A model folder's ``config.json``, or a hub model's from the Hugging Face cache.

    None when there is none to read: vLLM will say what is wrong.
    """
    try:
        return read_model_config(model, hub="cache")
    except ModelConfigError:
        return None


def _installed_vllm() -> str:
    """The installed vLLM release, without importing vLLM (or torch, as ``compat`` does)."""
    from hidden_state_connector.vllm_release import installed_vllm

    found = installed_vllm()
    return "(not installed)" if found is None else found[1]


def check_model_before_start(model: str, where: str) -> None:
    """``check_capturable`` for a model folder or hub id, before vLLM is started.

    Reads the model's ``config.json`` (a folder's, or a hub model's from the Hugging Face
    cache; the launchers fetch it there first when they need its layer count). When there
    is none, vLLM will say what is wrong, so nothing is refused here.

    Raises:
        UnsupportedArchitectureError: See ``check_capturable``.
    """
    config = _cached_config(model)
    if config is None:
        return
    architectures = [str(a) for a in config.get("architectures") or []]
    mla = uses_mla(config)
    check_capturable(architectures, mla=mla, vllm_version=_installed_vllm(), where=where)
