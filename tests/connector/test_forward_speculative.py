"""Forward capture beside a drafter (speculative decoding) on the CPU build: values, tokens, counts.

Each drafter runs in one real in-process vLLM engine with forward capture: ngram prompt
lookup (tiny Qwen3, prefix caching on) and EAGLE-3 (tiny Llama with a tiny echo drafter,
``apps.tiny_drafter``).
Every stored row is compared with Hugging Face's float32 residual stream; the token ids
must be the prompt plus the generated tokens fed back (what the same greedy run without
a drafter gives: HF's greedy continuation); each sample's drafted and accepted counts
must be vLLM's own per-request counts (``per_request_spec_decode_metrics``). Refusals
(the extract engine's method, async scheduling) are checked on real engine configs.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_kit import RTOL, engine, forward_extra, prompts
from hf_reference import Reference, read_one
from spec_kit import ngram, repetitive_prompts

from hidden_state_connector.apps.server import speculative_config
from hidden_state_connector.apps.tiny_drafter import build_tiny_eagle3
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_reader.format import sample_acceptance

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS // 2, NUM_LAYERS]
MAX_TOKENS = 24


def _run(
    model: Path, out: Path, spec: dict[str, Any], **settings: Any
) -> tuple[list[Any], list[Any]]:
    """Generated-token samples of repetitive and random prompts, and prompt-only ones.

    The prompt-only requests repeat earlier prompts: with prefix caching on, vLLM serves
    their prefixes from the cache (rows held from the first requests).
    """
    from vllm import SamplingParams

    llm = engine(
        model,
        out,
        forward_extra(LAYERS, include_output_tokens=True),
        speculative_config=spec,
        per_request_spec_decode_metrics="detailed",
        **settings,
    )
    try:
        every = repetitive_prompts() + prompts((150, 1, 17))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
        with_outputs = llm.generate([{"prompt_token_ids": p} for p in every], params)
        params.extra_args = {"kv_transfer_params": {"include_output_tokens": False}}
        prompt_only = llm.generate([{"prompt_token_ids": p} for p in every[::2]], params)
    finally:
        del llm
        gc.collect()
    return with_outputs, prompt_only


def _check(model: Path, with_outputs: list[Any], prompt_only: list[Any]) -> tuple[float, int, int]:
    """Every check of the module's docstring; the worst error and the summed counts."""
    reference = Reference(model, NUM_LAYERS)
    worst, drafted, accepted = 0.0, 0, 0
    for output in with_outputs + prompt_only:
        include = output in with_outputs
        sample = read_one(output.kv_transfer_params["hidden_states_path"])
        prompt, generated = list(output.prompt_token_ids), list(output.outputs[0].token_ids)
        assert len(generated) == MAX_TOKENS
        assert sample.token_ids.tolist() == (prompt + generated[:-1] if include else prompt)
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= RTOL, errors
        worst = max(worst, *errors.values())
        counts = sample_acceptance(sample.metadata)
        if not include:  # written when the prompt was complete, before any draft
            assert counts is None
            continue
        greedy = reference.model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
        )
        assert greedy[0, len(prompt) :].tolist() == generated  # speculation changed nothing
        assert counts is not None and 0 <= counts.accepted <= counts.drafted
        vllm_counts = output.outputs[0].spec_decode_metrics
        assert counts.accepted == sum(vllm_counts.per_step_accepted)
        assert counts.drafted <= vllm_counts.num_draft_tokens  # vLLM counts -1 pads too
        drafted, accepted = drafted + counts.drafted, accepted + counts.accepted
    return worst, drafted, accepted


def test_eagle3_capture_equals_hugging_face(
    tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp("forward-eagle3")
    model = build_tiny_model(base / "model", dtype="float32", num_layers=NUM_LAYERS)
    drafter = build_tiny_eagle3(base / "eagle3", model, echo=True)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}
    with_outputs, prompt_only = _run(model, base / "hs", spec)
    worst, drafted, accepted = _check(model, with_outputs, prompt_only)
    print(f"EAGLE-3 (Llama): worst relative error {worst:.1e}; accepted {accepted}/{drafted}")
    assert 0 < accepted < drafted  # both outcomes occurred: kept and recomputed rows


def test_ngram_capture_equals_hugging_face(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ngram's engine runs in processes of its own (vLLM's default), not in this one.

    Its proposer imports numba, and then every later engine of this process fails: vLLM
    0.32's CPU runner patches kernels by scanning every module's attributes
    (``triton_utils.dispatcher``) and breaks on llvmlite's ``_lib_fn_wrapper``.
    """
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    base = tmp_path_factory.mktemp("forward-ngram")
    model = build_tiny_model(base / "model", arch="qwen3", dtype="float32", num_layers=NUM_LAYERS)
    # Prefix caching on (forward capture's default with vLLM's): held prefix rows too.
    with_outputs, prompt_only = _run(
        model, base / "hs", ngram(), enable_prefix_caching=True, block_size=32
    )
    assert any(o.num_cached_tokens for o in prompt_only)
    worst, drafted, accepted = _check(model, with_outputs, prompt_only)
    print(
        f"ngram (Qwen3): worst relative error {worst:.1e}; accepted {accepted} of {drafted} drafts"
    )
    repetitive = [
        sample_acceptance(read_one(o.kv_transfer_params["hidden_states_path"]).metadata)
        for o in with_outputs[:3]
    ]
    assert "llvmlite" not in sys.modules  # the later engines of this process still start
    assert sum(c.accepted for c in repetitive if c is not None) > 0


def _setup_error(model: Path, **settings: Any) -> str:
    """The start-up check's message for an engine config with ``settings``."""
    from vllm.engine.arg_utils import EngineArgs

    from hidden_state_connector.engine.config import ConnectorConfig
    from hidden_state_connector.engine.forward.checks import ForwardCaptureError, forward_setup

    async_on = settings.pop("force_async", False)
    config = EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 26,
        enable_prefix_caching=False,
        **settings,
    ).create_engine_config()
    if async_on:  # what vLLM sets on CUDA for EAGLE (the CPU platform turns it off)
        config.scheduler_config.async_scheduling = True
    connector = ConnectorConfig.from_extra_config(
        {"capture": "forward", "layer_ids": [1], "shared_storage_path": "/tmp"}
    )
    with pytest.raises(ForwardCaptureError) as info:
        forward_setup(config, None, connector)
    return str(info.value)


def test_refusals_name_the_method_and_the_flag(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("forward-spec-refusals")
    model = build_tiny_model(base / "model", dtype="float32", num_layers=NUM_LAYERS)
    message = _setup_error(model, speculative_config=speculative_config([1, 2]))
    assert "'extract_hidden_states' is the extract engine's" in message
    drafter = build_tiny_eagle3(base / "eagle3", model)
    eagle3 = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}
    message = _setup_error(model, speculative_config=eagle3, force_async=True)
    assert "method 'eagle3' under vLLM's async scheduling" in message
    assert "--no-async-scheduling" in message
