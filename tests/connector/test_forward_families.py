"""Forward capture of the other model families on the CPU build, against HF float32.

One real in-process engine per family (tiny random models: hidden 128, head size 64, 2
layers, 4 experts; Nemotron-H 4 layers, one of each kind), every layer id captured, a
150-token prompt split by chunked prefill and longer than the sliding window, samples
with and without their generated tokens (``forward_kit.run_and_check``). The KV-cache
groups vLLM made are asserted too: Gemma 3, gpt-oss and Nemotron-H route rows through
the full-attention group of several. Then what is refused at start-up, by name.

DeepSeek's MLA backend depends on the CPU (``engine.cpu_build``): float32 runs on the
reference backend (CPU_MLA), asked for by name so every CPU runs the same one; bfloat16
runs on the backend vLLM picks for this CPU (AMX_MLA where it has AMX tiles). A CPU
with AMX is injected (``torch.cpu._is_amx_tile_supported``) to check the refusal of
float32 there, which no other CPU can show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_kit import forward_extra, refusal, run_and_check

from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_connector.engine.cpu_build import AMX_MLA, CPU_MLA, amx_tiles

pytestmark = pytest.mark.vllm

LENGTHS = (150, 1, 17)
FAMILIES: dict[str, tuple[int, set[str]]] = {
    # tiny-model --arch: (layers, the KV-cache group kinds vLLM makes for it)
    "qwen3_moe": (2, {"FullAttentionSpec"}),
    "gpt_oss": (2, {"FullAttentionSpec", "SlidingWindowSpec"}),
    "gemma3": (2, {"FullAttentionSpec", "SlidingWindowSpec"}),
    "deepseek_v2": (2, {"MLAAttentionSpec"}),  # with DeepSeek-V2's YaRN RoPE
    "nemotron_h": (4, {"FullAttentionSpec", "MambaSpec"}),
}
ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    # float32 MLA on the reference backend, on every CPU (AMX_MLA takes bfloat16 only)
    "deepseek_v2": {"attention_backend": CPU_MLA},
}
BF16_RTOL = 3e-2  # bfloat16's 8 bits of mantissa through a layer, against HF float32


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_rows_equal_hugging_face(
    arch: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    num_layers, groups = FAMILIES[arch]
    base = tmp_path_factory.mktemp(f"forward-{arch}")
    model = build_tiny_model(base / "model", arch=arch, dtype="float32", num_layers=num_layers)
    layers = list(range(num_layers + 1))  # the embeddings and every layer's output
    kwargs = ENGINE_KWARGS.get(arch, {})
    worst, found = run_and_check(model, base / "hs", layers, num_layers, LENGTHS, **kwargs)
    assert set(found) == groups, f"{arch}: KV-cache groups {found}"
    print(f"{arch}: worst relative error {worst:.1e}; KV-cache groups {found}")


def test_deepseek_in_bfloat16_on_the_mla_backend_of_this_cpu(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-deepseek-bf16")
    model = build_tiny_model(base / "model", arch="deepseek_v2", dtype="bfloat16", num_layers=2)
    backend = AMX_MLA if amx_tiles() else CPU_MLA  # what vLLM's CPU build picks here
    worst, found = run_and_check(
        model, base / "hs", [0, 1, 2], 2, LENGTHS, rtol=BF16_RTOL, dtype="bfloat16"
    )
    assert found == ["MLAAttentionSpec"]
    print(f"deepseek_v2 bfloat16 on {backend}: worst relative error {worst:.1e}")


def test_what_cannot_be_routed_or_differs_from_hf_is_refused_by_name(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-family-refusals")
    # DeepSeek-V2 in float16: vLLM rescales its residual stream.
    deepseek = build_tiny_model(
        base / "deepseek", arch="deepseek_v2", dtype="float32", num_layers=2
    )
    message = refusal(deepseek, base / "hs", forward_extra([1]), dtype="float16")
    assert "DeepseekV2ForCausalLM in float16" in message
    assert "use dtype bfloat16 or float32" in message
    # With plain RoPE: vLLM CPU's rotary kernel rotates MLA's query and key wrongly (about
    # 2e-2 from HF, measured with and without capture); PyTorch's rotary op is right.
    yarn = json.loads((deepseek / "config.json").read_text())["rope_parameters"]
    _edit_config(deepseek, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    message = refusal(deepseek, base / "hs", forward_extra([1]))
    assert "DeepseekV2ForCausalLM with plain RoPE on vLLM's CPU build" in message
    assert "'custom_ops': ['-rotary_embedding']" in message
    _edit_config(deepseek, rope_parameters=yarn)
    # float32 on a CPU with AMX tiles: vLLM would pick AMX_MLA and fail after loading.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        message = refusal(deepseek, base / "hs", forward_extra([1]))
    assert "DeepseekV2ForCausalLM in float32 on a CPU with AMX" in message
    assert "--dtype bfloat16" in message and "--attention-backend CPU_MLA" in message
    assert "expect weight to be bfloat16" not in message  # refused before vLLM's error
    # Gemma 3 with sliding-window layers only: no KV-cache group holds every token.
    gemma = build_tiny_model(base / "gemma", arch="gemma3", dtype="float32", num_layers=2)
    _edit_config(gemma, layer_types=["sliding_attention"] * 2)
    message = refusal(gemma, base / "hs", forward_extra([1]))
    assert (
        "Gemma3ForCausalLM: capture='forward' routes rows through a full-attention KV-cache "
        "group; this model has none (groups: SlidingWindowSpec)"
    ) in message


def _edit_config(model: Path, **changes: Any) -> None:
    config_file = model / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | changes))
