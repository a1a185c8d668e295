"""The scheduler half (``engine/scheduler_side.py``) on vLLM's own request statuses.

No engine: the scheduler half gets ``SimpleNamespace`` scheduler outputs shaped like
vLLM's ``SchedulerOutput`` (``scheduled_new_reqs``, ``scheduled_cached_reqs``,
``num_scheduled_tokens``, ``preempted_req_ids``, from ``engine_fakes``); a finished
request carries the installed vLLM's ``RequestStatus``, so the real abort check runs.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine_fakes import finished_request, new_request, scheduler_output

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import CapturePlan, scheduler_side
from hidden_state_connector.engine.handoff import same_process
from hidden_state_connector.engine.metadata import SaveOrder
from hidden_state_connector.engine.scheduler_side import ERROR_PARAM, PATH_PARAM, SchedulerSide
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_reader.format import lock_path

BLOCK_SIZE = 4
HS_GROUP = 1  # the hidden-state group is the second KV-cache group in these fakes


def _vllm_config(engine_id: str) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
    )


def _scheduler(root: Path, **extra: Any) -> SchedulerSide:
    config = ConnectorConfig(shared_storage_path=str(root), instance_id="unit", **extra)
    # A fresh engine id per test: nobody listens on its order channel, and no other
    # test's local_handoff registration can be found under it.
    engine_id = f"unit-{uuid.uuid4().hex}"
    return scheduler_side(
        config, _vllm_config(engine_id), CapturePlan(HS_GROUP, BLOCK_SIZE), WriteStats(0)
    )


def _finished(req_id: str, prompt: list[int], output: list[int]) -> SimpleNamespace:
    """A ``Request`` that ended normally (length cap), with vLLM's own status value."""
    from vllm.v1.request import RequestStatus

    return finished_request(req_id, prompt, output, RequestStatus.FINISHED_LENGTH_CAPPED)


class _Handoff:
    """A same-process writing worker (``handoff.same_process``) that records what it is given."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.orders: list[SaveOrder] = []

    def __enter__(self) -> _Handoff:
        same_process.register(self.key, self.orders.append)
        return self

    def __exit__(self, *exc: object) -> None:
        same_process.unregister(self.key, self.orders.append)


def test_prompt_in_two_chunks_is_ordered_once_in_the_step_that_completes_it(
    tmp_path: Path,
) -> None:
    sched = _scheduler(tmp_path)
    prompt = list(range(100, 110))  # 10 tokens: 3 blocks of 4
    path = str(tmp_path / "a.unit.safetensors")

    first = sched.build_metadata(
        scheduler_output(new=(new_request("a", prompt, [7, 3]),), scheduled={"a": 6})
    )
    assert [(n.req_id, n.path) for n in first.new_samples] == [("a", path)]
    assert first.saves == []  # 6 of 10 prompt tokens: not complete yet

    second = sched.build_metadata(scheduler_output(cached=(("a", 6, [9]),), scheduled={"a": 4}))
    assert second.new_samples == []
    [order] = second.saves
    assert order.req_id == "a"
    assert order.path == path
    assert order.written_this_step is True
    assert order.block_ids == [7, 3, 9]  # the hidden-state group's blocks of both steps
    assert order.token_ids == prompt
    assert order.num_prompt_tokens == 10
    assert order.failure is None

    # Decoding goes on (a new block, more tokens): no second order.
    for computed, blocks in ((10, [11]), (11, None), (12, None)):
        meta = sched.build_metadata(
            scheduler_output(cached=(("a", computed, blocks),), scheduled={"a": 1})
        )
        assert meta.saves == [] and meta.new_samples == []

    with _Handoff(sched.engine_key) as handoff:
        keep, params = sched.request_finished(_finished("a", prompt, [5, 6, 7]), [7, 3, 9, 11])
    assert keep is True  # blocks stay held until the worker has copied them
    assert params == {PATH_PARAM: path}
    assert handoff.orders == []  # nothing delivered at finish time ...
    assert sched.build_metadata(scheduler_output()).saves == []  # ... nor in the next metadata


def test_preempted_request_with_an_ordered_save_is_listed_for_the_worker(
    tmp_path: Path,
) -> None:
    sched = _scheduler(tmp_path)
    done_prompt, long_prompt = list(range(6)), list(range(50, 70))
    first = sched.build_metadata(
        scheduler_output(
            new=(new_request("done", done_prompt, [0, 1]), new_request("mid", long_prompt, [2, 3])),
            scheduled={"done": 6, "mid": 8},  # "mid" is still in its prefill
        )
    )
    assert [o.req_id for o in first.saves] == ["done"]

    # Both are preempted (their blocks are freed for reuse), and one id we never saw.
    second = sched.build_metadata(
        scheduler_output(preempted=frozenset({"done", "mid", "stranger"}))
    )
    assert second.preempted == ["done"]  # only the one whose copy may be in flight
    assert second.saves == []

    # Resumed with a new block table: no second order for "done"; "mid" restarts its
    # prefill from scratch on the new table and is ordered once complete.
    third = sched.build_metadata(
        scheduler_output(
            cached=(("done", 0, [8, 9]), ("mid", 0, [4, 5, 6, 10, 12])),
            resumed=frozenset({"done", "mid"}),
            scheduled={"done": 7, "mid": 20},
        )
    )
    assert [(o.req_id, o.block_ids) for o in third.saves] == [("mid", [4, 5, 6, 10, 12])]
    keep, params = sched.request_finished(_finished("done", done_prompt, [1, 2]), [8, 9])
    assert keep is True and ERROR_PARAM not in params


def test_include_output_tokens_is_ordered_at_finish_by_handoff_else_in_next_metadata(
    tmp_path: Path,
) -> None:
    sched = _scheduler(tmp_path)
    prompt = list(range(30, 37))  # 7 tokens
    params = {"include_output_tokens": True}
    meta = sched.build_metadata(
        scheduler_output(
            new=(
                new_request("h", prompt, [4, 5], params),
                new_request("m", prompt, [6, 7], params),
            ),
            scheduled={"h": 7, "m": 7},
        )
    )
    assert {n.req_id for n in meta.new_samples} == {"h", "m"}
    assert meta.saves == []  # the prompt is complete, but the last tokens are not known
    meta = sched.build_metadata(
        scheduler_output(cached=(("h", 7, [8]), ("m", 7, [9])), scheduled={"h": 1, "m": 1})
    )
    assert meta.saves == []

    # A same-process worker is registered: the order goes straight to it.
    with _Handoff(sched.engine_key) as handoff:
        keep, result = sched.request_finished(_finished("h", prompt, [90, 91, 92]), [4, 5, 8])
    assert keep is True and result == {PATH_PARAM: str(tmp_path / "h.unit.safetensors")}
    [order] = handoff.orders
    assert order.req_id == "h"
    assert order.token_ids == [*prompt, 90, 91]  # the last generated token has no state
    assert order.block_ids == [4, 5, 8]
    assert order.num_prompt_tokens == 7
    assert order.written_this_step is False and order.failure is None
    assert sched.build_metadata(scheduler_output()).saves == []

    # No worker in this process and nobody on the order channel: the next metadata.
    keep, result = sched.request_finished(_finished("m", prompt, [93, 94]), [6, 7, 9])
    assert keep is True and ERROR_PARAM not in result
    [queued] = sched.build_metadata(scheduler_output()).saves
    assert queued.req_id == "m" and queued.token_ids == [*prompt, 93]
    assert queued.block_ids == [6, 7, 9] and queued.written_this_step is False
    assert sched.build_metadata(scheduler_output()).saves == []  # delivered once


def test_unusable_custom_directory_is_refused_when_scheduled(tmp_path: Path) -> None:
    sched = _scheduler(tmp_path, allow_custom_save_path=True)
    (tmp_path / "blocker").write_text("a regular file where a directory is asked for")
    prompt = list(range(12))
    meta = sched.build_metadata(
        scheduler_output(
            new=(new_request("r", prompt, [0, 1, 2], {PATH_PARAM: "blocker/s.safetensors"}),),
            scheduled={"r": 12},
        )
    )
    assert meta.new_samples == []  # no lock is created
    assert meta.saves == []  # and nothing is ordered, although the prompt is complete
    with _Handoff(sched.engine_key) as handoff:
        keep, result = sched.request_finished(_finished("r", prompt, [3]), [0, 1, 2])
    assert keep is False  # the worker holds nothing: the blocks are freed at once
    assert result is not None
    assert result[PATH_PARAM] == str(tmp_path / "blocker" / "s.safetensors")
    assert "not a directory" in result[ERROR_PARAM]
    assert handoff.orders == [] and sched.build_metadata(scheduler_output()).saves == []
    assert sched.stats.total.refused_paths == 1
    assert not os.path.exists(lock_path(result[PATH_PARAM]))
