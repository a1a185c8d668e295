"""Generated tokens are stored right or refused: async scheduling (``engine/output_tokens.py``).

vLLM's async scheduling leaves the rows of a request's last step out of its cache blocks
(measured on an H100, ``benchmarks/gpu/results/2026-12-06.jsonl``), so the connector
refuses ``include_output_tokens`` there: per request with ``hidden_states_error``, at
start-up when it is the default, and ``hidden-state serve`` turns async scheduling off
when every request stores its generated tokens. Prompt-only capture is unaffected.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_fakes import new_request, scheduler_output

from hidden_state_connector.apps.server import ServeOptions
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import CapturePlan, scheduler_side
from hidden_state_connector.engine.output_tokens import (
    NO_ASYNC_FLAG,
    check_output_tokens_default,
    output_tokens_refusal,
)
from hidden_state_connector.engine.scheduler_side import ERROR_PARAM, SchedulerSide
from hidden_state_connector.engine.stats import WriteStats

BLOCK_SIZE, HS_GROUP = 4, 1


def _vllm_config(async_scheduling: bool | None) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=f"unit-{uuid.uuid4().hex}"),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        model_config=SimpleNamespace(has_inner_state=False, architectures=["LlamaForCausalLM"]),
    )


def _scheduler(root: Path, vllm_config: Any) -> SchedulerSide:
    config = ConnectorConfig(shared_storage_path=str(root), instance_id="unit")
    return scheduler_side(config, vllm_config, CapturePlan(HS_GROUP, BLOCK_SIZE), WriteStats(0))


def test_under_async_scheduling_a_request_for_generated_tokens_is_refused_loudly(
    tmp_path: Path,
) -> None:
    sched = _scheduler(tmp_path, _vllm_config(async_scheduling=True))
    prompt = list(range(8))
    wants_output = new_request("gen", prompt, [1, 2], {"include_output_tokens": True})
    prompt_only = new_request("plain", prompt, [3, 4])
    meta = sched.build_metadata(
        scheduler_output(new=(wants_output, prompt_only), scheduled={"gen": 8, "plain": 8})
    )
    # No lock, no order for the refused request; the prompt-only one is saved as ever.
    assert [n.req_id for n in meta.new_samples] == ["plain"]
    assert [o.req_id for o in meta.saves] == ["plain"]
    finished = SimpleNamespace(
        request_id="gen", prompt_token_ids=prompt, all_token_ids=[*prompt, 9, 9], status=None
    )
    keep, params = sched.request_finished(finished, [1, 2])
    assert keep is False  # nothing held: the blocks are freed at once
    assert params is not None and NO_ASYNC_FLAG in params[ERROR_PARAM]


@pytest.mark.parametrize("async_scheduling", [False, None])
def test_synchronous_engines_store_generated_tokens(async_scheduling: bool | None) -> None:
    assert output_tokens_refusal(_vllm_config(async_scheduling)) is None
    check_output_tokens_default(_vllm_config(async_scheduling), include_output_tokens=True)


def test_include_output_tokens_by_default_under_async_scheduling_refuses_to_start() -> None:
    with pytest.raises(ValueError, match=r"include_output_tokens is true.*--no-async-scheduling"):
        check_output_tokens_default(_vllm_config(True), include_output_tokens=True)
    check_output_tokens_default(_vllm_config(True), include_output_tokens=False)


def test_serve_turns_async_scheduling_off_only_when_every_request_stores_generated_tokens() -> None:
    def command(connector: dict[str, Any], vllm_args: list[str]) -> list[str]:
        options = ServeOptions("m", "/data/hs", [1, 2], connector=connector, vllm_args=vllm_args)
        return options.command()

    assert NO_ASYNC_FLAG in command({"include_output_tokens": True}, [])
    assert NO_ASYNC_FLAG not in command({}, [])
    # The user's own choice stands.
    chosen = command({"include_output_tokens": True}, ["--async-scheduling"])
    assert chosen.count("--async-scheduling") == 1 and NO_ASYNC_FLAG not in chosen
