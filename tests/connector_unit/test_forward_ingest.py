"""Forward capture's per-step hand-off: host copies, the ingest thread, the compile-cache key.

The engine's thread only starts a step's copy and queues a work item; the ingest thread
runs items strictly in order and survives a failing one. The compile-cache key is checked
on a real vLLM config: code compiled without the capture must hash apart.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.arena import RowArena
from hidden_state_connector.engine.forward.ingest import IngestThread
from hidden_state_connector.engine.forward.install import COMPILE_CACHE_KEY, key_compile_cache
from hidden_state_connector.engine.forward.rows import one_torch_thread
from hidden_state_connector.engine.forward.transfer import StepTransfer


def test_ingest_runs_items_in_order_and_survives_a_failing_one() -> None:
    errors: list[BaseException] = []
    ran: list[int] = []
    ingest = IngestThread("test-ingest", errors.append)
    gate = threading.Event()
    ingest.put(gate.wait)  # items queue up behind a slow one
    for i in range(50):
        ingest.put(lambda i=i: ran.append(i))
    ingest.put(lambda: 1 / 0)
    ingest.put(lambda: ran.append(50))
    assert not ingest.drain(timeout=0.05)
    gate.set()
    assert ingest.stop(timeout=10)
    assert ran == list(range(51))
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)


def test_the_ingest_thread_runs_torch_on_one_thread_and_leaves_the_callers_alone() -> None:
    # Routing is many small operators: a team of torch threads per operator would wait
    # for cores the engine's threads hold. The setting is the ingest thread's own.
    before = torch.get_num_threads()
    seen: list[int] = []
    ingest = IngestThread("test-ingest", lambda exc: None, one_torch_thread)
    ingest.put(lambda: seen.append(torch.get_num_threads()))
    assert ingest.stop(timeout=10)
    broken = IngestThread("test-ingest-broken", lambda exc: None, lambda: 1 / 0)
    broken.put(lambda: seen.append(-1))  # a failed setting does not stop the work
    assert broken.stop(timeout=10)
    assert seen == [1, -1]
    assert torch.get_num_threads() == before


def test_transfer_copies_each_step_and_holds_a_bounded_ring() -> None:
    staging = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    transfer = StepTransfer(staging, depth=2)
    first = transfer.submit(5, torch.arange(8))
    staging.add_(1000)  # the next forward pass overwrites the staging
    second = transfer.submit(3, torch.arange(8) + 10)
    first.wait()
    # Token-major on the host: [tokens, layers, hidden], the arena's layout.
    expected = torch.arange(48, dtype=torch.float32).view(2, 8, 3)[:, :5].transpose(0, 1)
    assert torch.equal(first.rows, expected)
    assert second.slots.tolist() == [10, 11, 12]
    took = threading.Event()
    waiting = threading.Thread(target=lambda: (transfer.submit(1, torch.arange(8)), took.set()))
    waiting.start()
    assert not took.wait(0.2)  # both buffers are in use: the engine's thread waits
    transfer.done(first)
    assert took.wait(5)
    waiting.join()
    assert transfer.host_bytes == 2 * (2 * 8 * 3 * 4 + 8 * 8)


def test_arena_stores_many_requests_in_one_scatter() -> None:
    arena = RowArena(1 << 20, 4, 2, 3, torch.float32)
    rows = torch.randn(12, 2, 3)  # [tokens, layers, hidden]
    # Entries: a (rows 0-5 -> positions 0-5), b (rows 9..6 -> 3..0), c (its rows 0-1
    # never came), a refused entry (None) whose row 11 must not be stored anywhere.
    row_index = torch.tensor([0, 1, 2, 3, 4, 5, 9, 8, 7, 6, 10, 11])
    owner = torch.tensor([0] * 6 + [1] * 4 + [2, 3])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 3, 2, 1, 0, 2, 0])
    entries = [("a", 0, 6), ("b", 0, 4), ("c", 2, 3), None]
    failures = arena.write_step(entries, row_index, owner, positions, rows)
    assert set(failures) == {2} and "[0, 2)" in failures[2]
    a = arena.data[arena.blocks("a")].reshape(-1, 2, 3)[:6]
    b = arena.data[arena.blocks("b")].reshape(-1, 2, 3)[:4]
    assert torch.equal(a, rows[:6])
    assert torch.equal(b, rows[[6, 7, 8, 9]])
    assert arena.filled("a") == 6 and arena.filled("b") == 4 and arena.filled("c") == 0
    c = arena.data[arena.blocks("c")].reshape(-1, 2, 3)
    assert torch.equal(c[2], rows[10])  # stored, though the sample will fail
    held = torch.cat([a, b, c])
    assert not any(torch.equal(row, rows[11]) for row in held)  # the refused entry's


def test_a_deferred_scatter_places_rows_now_and_moves_them_later() -> None:
    # The ingest thread places a step's rows holding the lock the engine's thread takes
    # every step, and moves the bytes after letting go of it.
    arena = RowArena(1 << 20, 4, 2, 3, torch.float32)
    with torch.inference_mode():
        arena.data.zero_()
    rows = torch.randn(5, 2, 3) + 10
    copies: list = []
    entries = [("a", 0, 5)]
    index, owner = torch.arange(5), torch.zeros(5, dtype=torch.int64)
    assert arena.write_step(entries, index, owner, torch.arange(5), rows, deferred=copies) == {}
    assert arena.filled("a") == 5 and len(arena.blocks("a")) == 2  # placed ...
    assert not arena.data.any()  # ... not yet copied
    (copy,) = copies
    copy()
    stored = arena.data[arena.blocks("a")].reshape(-1, 2, 3)[:5]
    assert torch.equal(stored, rows)


@pytest.mark.vllm
def test_the_capture_gets_a_compile_cache_key_of_its_own(tiny_model_fp32: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(tiny_model_fp32), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 26
    ).create_engine_config()
    before = config.compute_hash()
    key_compile_cache(config, [1, 2])
    assert config.additional_config[COMPILE_CACHE_KEY]["layer_ids"] == [1, 2]
    assert config.compute_hash() != before


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"pipeline_parallel_size": 2, "enable_prefix_caching": True},
            "pipeline parallelism with prefix caching is not supported yet",
        ),
        (
            {"enable_prefix_caching": True, "block_size": 40},
            "with prefix caching, block_size must be a multiple of 16",
        ),
    ],
)
def test_start_up_refuses_what_forward_capture_cannot_store(
    tiny_model_fp32: Path, setting: dict[str, object], message: str
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from hidden_state_connector.engine.config import ConnectorConfig
    from hidden_state_connector.engine.forward.checks import ForwardCaptureError, forward_setup

    config = EngineArgs(
        model=str(tiny_model_fp32),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 26,
        distributed_executor_backend="mp",
        **setting,  # type: ignore[arg-type]
    ).create_engine_config()
    connector = ConnectorConfig.from_extra_config(
        {"capture": "forward", "layer_ids": [1], "shared_storage_path": "/tmp"}
    )
    with pytest.raises(ForwardCaptureError, match=message):
        forward_setup(config, None, connector)


def test_a_step_keeps_its_block_ids_while_later_steps_are_scheduled(tmp_path: Path) -> None:
    """The ingest thread may run steps behind the scheduler (async scheduling on a GPU).

    A step's block table must not grow when the scheduler adds blocks in a later step:
    it did (the first step's list was the request's own table), so the router's table got
    duplicates and the rows of the request's next block were not found (seen on an H100:
    "10 rows of the batch map to tokens [710, 735) of this request, expected 25").
    """
    from types import SimpleNamespace

    from engine_fakes import new_request, scheduler_output

    from hidden_state_connector.engine.engines import CapturePlan, scheduler_side
    from hidden_state_connector.engine.stats import WriteStats

    config = ConnectorConfig(
        shared_storage_path=str(tmp_path), capture="forward", layer_ids=[1], instance_id="u"
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="fake-model", get_hidden_size=lambda: 8, dtype=torch.float32
        ),  # the row size (the arena's room is counted on this side)
        kv_transfer_config=SimpleNamespace(engine_id="unit-forward-steps"),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
    )
    scheduler = scheduler_side(config, vllm_config, CapturePlan(1, 4), WriteStats(0))
    first = scheduler.build_metadata(
        scheduler_output(new=(new_request("a", list(range(20)), [7, 8]),), scheduled={"a": 8})
    )
    scheduler.build_metadata(scheduler_output(cached=(("a", 8, [9]),), scheduled={"a": 4}))
    assert first.steps[0].block_ids == [7, 8]
