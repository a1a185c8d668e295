"""Forward capture under prefix caching (vLLM's default) on the CPU build, against HF float32.

One real in-process engine (tiny Llama, block size 32, chunked prefill at 64 tokens),
prefix caching on. Requests that vLLM serves partly from its prefix cache compute only
their new tokens; their samples must still hold a row for every token, equal to Hugging
Face's float32 residual stream (``forward_kit.RTOL``):

- GRPO-like: samples of one prompt submitted together (they hit the blocks the first one
  fills in the same step) and prompts sharing a system prompt, then more of them after
  the first ones finished (rows held after their requests ended);
- multi-turn: the next turn's prompt is the last turn's prompt and reply; the reply's
  rows are held only where the last turn stored its generated tokens, else the request
  skips the prefix cache and computes them;
- a ``prefix_rows_bytes`` too small for a prefix: requests recompute it, rows still right;
  a ``capture_buffer_bytes`` too small for the requests at once: they wait for room.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_kit import RTOL, engine, forward_extra
from hf_reference import Reference, read_one

from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_reader.files.locks import SharedLock, read_status
from hidden_state_reader.format import lock_path

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS]
BLOCK = 32  # the CPU build's attention takes multiples of 32
SYSTEM = 100  # tokens of the shared system prompt (3 full blocks)


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=gen).tolist()


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, outputs: bool) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,  # the CPU build takes no per-request seed
        ignore_eos=True,
        detokenize=False,
        extra_args={"kv_transfer_params": {"include_output_tokens": outputs}},
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # type: ignore[no-any-return]


def _check(reference: Reference, results: list[tuple[Any, bool]]) -> float:
    """Every sample's tokens and rows; the worst relative error."""
    worst = 0.0
    for output, outputs in results:
        params = output.kv_transfer_params
        assert "hidden_states_error" not in params, params
        sample = read_one(params["hidden_states_path"])
        prompt = list(output.prompt_token_ids)
        generated = list(output.outputs[0].token_ids)
        assert sample.token_ids.tolist() == (prompt + generated[:-1] if outputs else prompt)
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= RTOL, f"relative errors {errors}"
        worst = max(worst, *errors.values())
    return worst


def _engine(model: Path, out: Path, **extra: Any) -> Any:
    return engine(
        model,
        out,
        forward_extra(LAYERS, **extra),
        enable_prefix_caching=True,
        block_size=BLOCK,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("forward-prefix-model")
    return build_tiny_model(base / "model", dtype="float32", num_layers=NUM_LAYERS)


def test_cached_prefixes_get_the_rows_computed_when_they_were_first_filled(
    model: Path, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    out = tmp_path_factory.mktemp("forward-prefix-hs")
    gen = torch.Generator().manual_seed(0)
    system = _tokens(gen, SYSTEM)
    group = system + _tokens(gen, 30)
    llm = _engine(model, out)
    try:
        # One prompt four times (GRPO's samples) and two more sharing its system prompt.
        first = _generate(llm, [group] * 4 + [system + _tokens(gen, n) for n in (9, 40)], 20, True)
        # After they finished: their prefix rows are held.
        later = _generate(llm, [system + _tokens(gen, 25), group], 20, False)
        # Multi-turn: last turn's prompt and reply, then the next message. Turn one stored
        # its generated tokens (rows held); turn "b" did not (its reply is recomputed).
        turn = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in first[4:6]]
        nexts = _generate(llm, [turn[0] + _tokens(gen, 7)], 10, True)
        first_prompt_only = _generate(llm, [system + _tokens(gen, 50)], 40, False)
        replay = list(first_prompt_only[0].prompt_token_ids) + list(
            first_prompt_only[0].outputs[0].token_ids
        )
        recomputed = _generate(llm, [replay + _tokens(gen, 5)], 5, True)
    finally:
        del llm
        gc.collect()
    cached = [o.num_cached_tokens for o in first + later + nexts + recomputed]
    print(f"cached tokens per request: {cached}")
    # Every sample of the group after the first starts from the blocks the first one
    # computes in the same step (vLLM lets them in in the same scheduling pass).
    assert min(o.num_cached_tokens for o in first[1:4]) >= 4 * BLOCK
    assert all(o.num_cached_tokens >= 3 * BLOCK for o in later)  # held after the requests
    assert nexts[0].num_cached_tokens >= 4 * BLOCK  # the reply's block too (stored with it)
    # The prompt-only turn's reply has no rows: that request skipped the prefix cache.
    assert recomputed[0].num_cached_tokens == 0
    reference = Reference(model, NUM_LAYERS)
    results = [(o, True) for o in first] + [(o, False) for o in later]
    results += [(o, True) for o in nexts + recomputed] + [(first_prompt_only[0], False)]
    worst = _check(reference, results)
    print(f"prefix caching: worst relative error {worst:.1e}")


def test_small_budgets_make_requests_wait_or_recompute_never_fail(
    model: Path, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    """A prefix over ``prefix_rows_bytes`` is recomputed; requests whose rows do not fit
    ``capture_buffer_bytes`` beside the running ones wait for room (back-pressure); a
    prompt larger than the whole arena fails its sample, naming the setting."""
    out = tmp_path_factory.mktemp("forward-prefix-budget")
    gen = torch.Generator().manual_seed(1)
    prompt = _tokens(gen, SYSTEM + 20)
    token_bytes = 3 * 128 * 4  # 3 layers x 128 x float32
    # Room for two blocks' rows: the 3-block prefix is never held whole, so no request
    # may start from it. The arena holds that and 1.5 requests' rows (120 + 8 tokens).
    held = 2 * BLOCK * token_bytes
    arena = held + 192 * token_bytes
    llm = _engine(model, out, prefix_rows_bytes=held, capture_buffer_bytes=arena)
    try:
        outputs = _generate(llm, [prompt] * 3, 8, True) + _generate(llm, [prompt], 8, True)
        too_big = _generate(llm, [_tokens(gen, 300)], 2, False)[0].kv_transfer_params
        # Its sample fails once its rows run out of room, maybe after the response went
        # (a prompt-only sample is written while the request decodes): the lock tells.
        lock = SharedLock.acquire(too_big["hidden_states_path"], timeout=60)
        assert lock is not None
        lock.release()
        rows = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.rows
        waits, in_use = rows.admission.waits, rows.admission.blocks_in_use
    finally:
        del llm
        gc.collect()
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0]
    worst = _check(Reference(model, NUM_LAYERS), [(o, True) for o in outputs])
    assert waits > 0 and in_use == 0  # requests waited; every request's rows were let go
    status = read_status(lock_path(too_big["hidden_states_path"]))
    assert status.failed and "capture_buffer_bytes" in status.reason, status
    assert not os.path.exists(too_big["hidden_states_path"])
    print(f"small budgets: {waits} waits; worst relative error {worst:.1e}")


def test_a_prompt_only_requests_rows_count_until_its_sample_is_written(
    model: Path, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    """Back-pressure lets a prompt-only request's rows go once its sample is copied out
    (the worker tells the scheduler half through vLLM's worker metadata), not when the
    request ends: with an arena for two prompts, four long-decoding requests run at once.
    (Before, the last two waited until the first two had generated every token.)"""
    from vllm import SamplingParams

    out = tmp_path_factory.mktemp("forward-let-go")
    gen = torch.Generator().manual_seed(3)
    prompts = [_tokens(gen, 64) for _ in range(4)]
    token_bytes = 3 * 128 * 4  # 3 layers x 128 x float32
    held = 2 * BLOCK * token_bytes
    llm = _engine(model, out, prefix_rows_bytes=held, capture_buffer_bytes=held + 128 * token_bytes)
    params = SamplingParams(
        max_tokens=120,  # decoding outlasts a 64-row sample's copy by far
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        extra_args={"kv_transfer_params": {"include_output_tokens": False}},
    )
    try:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        for i, prompt in enumerate(prompts):
            engine.add_request(f"let-go-{i}", {"prompt_token_ids": prompt}, params)
        finished: list[Any] = []
        most_running = 0
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
            most_running = max(most_running, len(scheduler.running))
        admission = scheduler.connector._scheduler.rows.admission
        waits, in_use = admission.waits, admission.blocks_in_use
    finally:
        del llm
        gc.collect()
    assert most_running == 4, most_running
    assert waits > 0 and in_use == 0  # the last two waited for room; nothing left counted
    worst = _check(Reference(model, NUM_LAYERS), [(o, False) for o in finished])
    assert len(finished) == 4
    print(f"let go once written: {waits} waits; worst relative error {worst:.1e}")


def test_the_default_config_captures_from_the_forward_pass(
    model: Path, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    """No ``capture`` key, no ``layer_ids``, no speculative config, prefix caching on and
    the block size vLLM picks: forward capture of EAGLE-3's layers and the last one."""
    out = tmp_path_factory.mktemp("forward-default")
    gen = torch.Generator().manual_seed(2)
    shared = _tokens(gen, 300)
    prompts = [shared + _tokens(gen, 20), shared + _tokens(gen, 20)]
    group = _tokens(gen, 300)
    extra = {"include_output_tokens": True, "stats_interval": 0}
    # vLLM's defaults: prefix caching on, its own batch size (the whole group in one step).
    llm = engine(model, out, extra, enable_prefix_caching=True, max_num_batched_tokens=None)
    try:
        grpo = _generate(llm, [group] * 4, 6, True)
        outputs = _generate(llm, prompts[:1], 6, True) + _generate(llm, prompts * 2, 6, True)
        block = llm.llm_engine.vllm_config.cache_config.block_size
    finally:
        del llm
        gc.collect()
    # GRPO's samples of one prompt, let in in one scheduling pass: every one after the
    # first starts from the full blocks the first computes in that same step.
    assert [o.num_cached_tokens for o in grpo] == [0] + [300 // block * block] * 3
    assert max(o.num_cached_tokens for o in outputs) >= block  # the shared prefix hit
    outputs += grpo
    for output in outputs:
        sample = read_one(output.kv_transfer_params["hidden_states_path"])
        assert sample.layer_ids == [1, 2, NUM_LAYERS]  # [2, N/2, N-3, N] of 4 layers
    worst = _check(Reference(model, NUM_LAYERS), [(o, True) for o in outputs])
    print(f"default config (block size {block}): worst relative error {worst:.1e}")
