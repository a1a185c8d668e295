"""Choices vLLM's CPU build makes by the machine it runs on that decide what can be captured.

Two of them make a model's rows fail or differ from Hugging Face's, so the connector
refuses them at start-up by name, before vLLM's own error:

- Multi-head latent attention (DeepSeek, Kimi) runs on the AMX MLA backend on an x86
  CPU with AMX tiles, unless the reference backend (``CPU_MLA``) is asked for; the AMX
  backend takes bfloat16 only and fails after the weights are loaded otherwise. The same
  model in float32 runs on ``CPU_MLA`` on every CPU.
- MLA with plain RoPE runs vLLM's in-place rotary kernel, which rotates MLA's query and
  key wrongly, unless that custom op is turned off.
"""

from __future__ import annotations

from typing import Any

import torch

AMX_MLA = "AMX_MLA"
CPU_MLA = "CPU_MLA"


def _is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (what vLLM's CPU build asks before choosing AMX_MLA)."""
    import platform

    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    is_x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return bool(is_x86 and supported is not None and supported())


def mla_backend(vllm_config: Any) -> str | None:
    """The MLA backend vLLM's CPU build will run this engine's model on (None: no MLA here).

    Mirrors ``CpuPlatform.get_attn_backend_cls`` (vLLM 0.32): AMX_MLA where the CPU has
    AMX tiles, unless CPU_MLA is asked for (``attention_backend``); CPU_MLA otherwise.
    DeepSeek-V4 has attention backends of its own.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not getattr(model_config, "use_mla", False) or not _is_cpu_build():
        return None
    if getattr(getattr(model_config, "hf_config", None), "model_type", None) == "deepseek_v4":
        return None
    asked = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if getattr(asked, "name", asked) == CPU_MLA:
        return CPU_MLA
    return AMX_MLA if amx_tiles() else CPU_MLA


def amx_mla_dtype_refusal(vllm_config: Any) -> str | None:
    """Why the AMX MLA backend would fail on this engine's dtype (None: it would not).

    The backend packs its weights as bfloat16 (float16, int8 and fp8 weights aside), so a
    float32 model fails in vLLM after loading with an error that names neither the model
    nor what works.
    """
    if mla_backend(vllm_config) != AMX_MLA:
        return None
    model_config = vllm_config.model_config
    dtype = model_config.dtype
    if dtype == torch.bfloat16:
        return None
    name = "/".join(getattr(model_config, "architectures", None) or []) or "this model"
    shown = str(dtype).removeprefix("torch.")
    return (
        f"{name} in {shown} on a CPU with AMX: vLLM's CPU build runs multi-head latent "
        f"attention on its AMX backend ({AMX_MLA}), which takes bfloat16 only. Start vLLM "
        f"with dtype bfloat16 (--dtype bfloat16), or keep {shown} on the reference backend: "
        f"attention_backend='{CPU_MLA}' (--attention-backend {CPU_MLA})"
    )


def cpu_rotary_kernel(vllm_config: Any) -> bool:
    """Whether vLLM's CPU rotary kernel would rotate this model's MLA query and key.

    DeepSeek's YaRN scaling (``DeepseekScalingRotaryEmbedding``) uses PyTorch ops on CPU;
    plain RoPE uses the ``rotary_embedding`` custom op unless it is turned off.
    """
    if not _is_cpu_build():
        return False
    hf_config = vllm_config.model_config.hf_config
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    ops = list(getattr(vllm_config.compilation_config, "custom_ops", None) or [])
    turned_off = "-rotary_embedding" in ops or ("none" in ops and "+rotary_embedding" not in ops)
    return rope_type == "default" and not turned_off
