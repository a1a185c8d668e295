"""Forward capture (``capture: "forward"``, preview) on the CPU build: values, refusals, capacity.

Each family runs in one real in-process vLLM engine with no speculative config; its samples
(prompts split by chunked prefill, generated tokens included or not) are compared with
Hugging Face's float32 residual stream. Refusals are checked at start-up by their message.
The KV-cache capacity test starts three engines in turn (no capture, forward, extract).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import Reference, read_one

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_connector.apps.tiny_model import build_tiny_model

from procs import IN_PROCESS_ENGINE

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS // 2, NUM_LAYERS]  # embeddings, first, middle, last (pre-norm)
RTOL = 1e-5
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """The engine in this process (see procs.IN_PROCESS_ENGINE)."""
    env = pytest.MonkeyPatch()
    for key, value in IN_PROCESS_ENGINE.items():
        env.setenv(key, value)
    yield
    env.undo()


def _forward(layers: list[int] = LAYERS, **extra: Any) -> dict[str, Any]:
    return {"capture": "forward", "layer_ids": layers, "stats_interval": 0, **extra}


def _engine(model: Path, out: Path | None, extra: dict[str, Any] | None, **kwargs: Any) -> Any:
    from vllm import LLM

    settings: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 1024,
        "max_num_batched_tokens": 64,  # the 150-token prompt takes chunked prefill
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 * 1024**2,
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    if extra is not None:
        settings["kv_transfer_config"] = kv_transfer_config(str(out), extra)
    return LLM(**(settings | kwargs))


def _generate(llm: Any, prompts: list[list[int]], params: dict[str, Any] | None) -> list[Any]:
    from vllm import SamplingParams

    sampling = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        detokenize=False,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)  # type: ignore[no-any-return]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 1, 17, 90)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_capture_equals_hugging_face(
    arch: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp(f"forward-{arch}")
    model = build_tiny_model(base / "model", arch=arch, dtype="float32", num_layers=NUM_LAYERS)
    llm = _engine(model, base / "hs", _forward(include_output_tokens=True))
    try:
        with_outputs = _generate(llm, _prompts(), None)
        prompt_only = _generate(llm, _prompts()[::2], {"include_output_tokens": False})
    finally:
        del llm
        gc.collect()
    reference = Reference(model, NUM_LAYERS)
    worst = 0.0
    for output, include in [(o, True) for o in with_outputs] + [(o, False) for o in prompt_only]:
        sample = read_one(output.kv_transfer_params["hidden_states_path"])
        prompt = list(output.prompt_token_ids)
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == MAX_TOKENS
        # The last generated token is never fed back: it has no hidden state.
        assert sample.token_ids.tolist() == (prompt + generated[:-1] if include else prompt)
        assert sample.layer_ids == LAYERS
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= RTOL, f"{arch}: relative errors {errors}"
        worst = max(worst, *errors.values())
    print(f"{arch}: worst relative error {worst:.1e}")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _refusal(model: Path, out: Path, extra: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(Exception) as info:  # vLLM wraps what the engine raised
        _engine(model, out, extra, **kwargs)
    gc.collect()
    return "".join(str(e) for e in _chain(info.value))


def test_refusals_name_the_setting(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-refusals")
    gemma = build_tiny_model(base / "gemma", arch="gemma3", dtype="float32", num_layers=NUM_LAYERS)
    message = _refusal(gemma, base / "hs", _forward())
    assert "capture='forward' does not support Gemma3ForCausalLM yet" in message
    llama = build_tiny_model(base / "llama", dtype="float32", num_layers=NUM_LAYERS)
    message = _refusal(llama, base / "hs", _forward(), enable_prefix_caching=True)
    assert "prefix caching is not supported yet" in message
    assert "--no-enable-prefix-caching" in message
    message = _refusal(llama, base / "hs", _forward([1, 9]))
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
        ("forward", _forward(LAYERS[1:]), {}),
        ("extract", extract, {"speculative_config": speculative_config(LAYERS[1:])}),
    ]:
        llm = _engine(model, base / name, extra, **kwargs)
        found[name] = _capacity(llm)
        del llm
        gc.collect()
    print(
        f"KV-cache capacity (tokens, blocks), 64 MiB, layers 1, 2, 4 of a 128-wide model: {found}"
    )
    assert found["forward"][0] >= 0.99 * found["none"][0]
    assert found["extract"][0] < found["none"][0]  # its hidden-state group shares the cache
