"""Helpers of the forward-capture tests (``tests/connector/test_forward_capture.py``,
``test_forward_families.py``): the engine, its requests and the check of every stored
row against Hugging Face float32.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import Reference, read_one

from hidden_state_connector.apps.server import kv_transfer_config

RTOL = 1e-5
MAX_TOKENS = 5


def forward_extra(layers: list[int], **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` of forward capture of ``layers``."""
    return {"capture": "forward", "layer_ids": layers, "stats_interval": 0, **extra}


def engine(model: Path, out: Path | None, extra: dict[str, Any] | None, **kwargs: Any) -> Any:
    """An in-process ``LLM`` (float32, eager, chunked prefill at 64 tokens) with the connector."""
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


def generate(llm: Any, prompts: list[list[int]], params: dict[str, Any] | None) -> list[Any]:
    """Greedy ``MAX_TOKENS`` tokens of each prompt, with ``kv_transfer_params`` if given."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        detokenize=False,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)  # type: ignore[no-any-return]


def prompts(lengths: tuple[int, ...] = (150, 1, 17, 90)) -> list[list[int]]:
    """Random prompts of ``lengths`` tokens (the same ones every run)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]


def kv_cache_groups(llm: Any) -> list[str]:
    """The kind (spec class name) of each KV-cache group of an in-process engine."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups]


def run_and_check(
    model: Path,
    out: Path,
    layers: list[int],
    num_layers: int,
    lengths: tuple[int, ...],
    rtol: float = RTOL,
    **engine_kwargs: Any,
) -> tuple[float, list[str]]:
    """Capture ``layers`` with and without generated tokens; every row checked against HF.

    ``rtol`` bounds each layer's relative error (float32's by default; a bfloat16 engine
    needs bfloat16's); ``engine_kwargs`` go to the engine (``engine``).

    Returns:
        The worst relative error of any captured layer of any sample, and the engine's
        KV-cache groups (``kv_cache_groups``).
    """
    extra = forward_extra(layers, include_output_tokens=True)
    llm = engine(model, out, extra, **engine_kwargs)
    try:
        groups = kv_cache_groups(llm)
        with_outputs = generate(llm, prompts(lengths), None)
        prompt_only = generate(llm, prompts(lengths)[::2], {"include_output_tokens": False})
    finally:
        del llm
        gc.collect()
    reference = Reference(model, num_layers)
    worst = 0.0
    for output, include in [(o, True) for o in with_outputs] + [(o, False) for o in prompt_only]:
        sample = read_one(output.kv_transfer_params["hidden_states_path"])
        prompt = list(output.prompt_token_ids)
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == MAX_TOKENS
        # The last generated token is never fed back: it has no hidden state.
        assert sample.token_ids.tolist() == (prompt + generated[:-1] if include else prompt)
        assert sample.layer_ids == layers
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= rtol, f"{model.parent.name}: relative errors {errors}"
        worst = max(worst, *errors.values())
    return worst, groups


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def refusal(model: Path, out: Path, extra: dict[str, Any], **kwargs: Any) -> str:
    """The messages of the error (and its causes) an engine start raised."""
    with pytest.raises(Exception) as info:  # vLLM wraps what the engine raised
        engine(model, out, extra, **kwargs)
    gc.collect()
    return "".join(str(e) for e in _chain(info.value))
