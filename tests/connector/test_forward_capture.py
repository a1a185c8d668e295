"""Forward capture (the default engine) on the CPU build: values, refusals, capacity.

Each family runs in one real in-process vLLM engine with no speculative config; its samples
(prompts split by chunked prefill, generated tokens included or not) are compared with
Hugging Face's float32 residual stream. Refusals are checked at start-up by their message.
The KV-cache capacity test starts three engines in turn (no capture, forward, extract).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from forward_kit import engine, forward_extra, refusal, run_and_check

from hidden_state_connector.apps.server import speculative_config
from hidden_state_connector.apps.tiny_model import build_tiny_model

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS // 2, NUM_LAYERS]  # embeddings, first, middle, last (pre-norm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_capture_equals_hugging_face(
    arch: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp(f"forward-{arch}")
    model = build_tiny_model(base / "model", arch=arch, dtype="float32", num_layers=NUM_LAYERS)
    worst, _ = run_and_check(model, base / "hs", LAYERS, NUM_LAYERS, (150, 1, 17, 90))
    print(f"{arch}: worst relative error {worst:.1e}")


def test_refusals_name_the_setting(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-refusals")
    llama = build_tiny_model(base / "llama", dtype="float32", num_layers=NUM_LAYERS)
    message = refusal(
        llama, base / "hs", forward_extra(LAYERS), enable_prefix_caching=True, block_size=8
    )
    assert "with prefix caching, block_size must be a multiple of 16" in message
    assert "--no-enable-prefix-caching" in message
    message = refusal(llama, base / "hs", forward_extra([1, 9]))
    assert "layer_ids [1, 9]: the model has 4 layers" in message


def _capacity(llm: Any) -> tuple[int, int]:
    """vLLM's reported KV-cache token capacity and its number of blocks."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.kv_cache_size_tokens), int(cache.num_gpu_blocks)


def test_forward_capture_takes_no_kv_cache_capacity(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-capacity")
    model = build_tiny_model(base / "model", dtype="float32", num_layers=NUM_LAYERS)
    found = {}
    extract = {"stats_interval": 0}
    for name, extra, kwargs in [
        ("none", None, {}),
        ("forward", forward_extra(LAYERS[1:]), {}),
        ("extract", extract, {"speculative_config": speculative_config(LAYERS[1:])}),
    ]:
        llm = engine(model, base / name, extra, **kwargs)
        found[name] = _capacity(llm)
        del llm
        gc.collect()
    print(
        f"KV-cache capacity (tokens, blocks), 64 MiB, layers 1, 2, 4 of a 128-wide model: {found}"
    )
    assert found["forward"][0] >= 0.99 * found["none"][0]
    assert found["extract"][0] < found["none"][0]  # its hidden-state group shares the cache
