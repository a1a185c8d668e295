"""Fast unit tests of the delivery path: scheduler half, write pipeline, order channel.

No engine: the scheduler half gets ``SimpleNamespace`` scheduler outputs shaped like
vLLM's ``SchedulerOutput`` (``scheduled_new_reqs``, ``scheduled_cached_reqs``,
``num_scheduled_tokens``, ``preempted_req_ids``), the write pipeline a real CPU tensor as
its hidden-state cache and real files in ``tmp_path``, the order channel a real abstract
Unix socket. Mocks only inject faults (a blocked disk write).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_fakes import finished_request, new_request, scheduler_output

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.handoff import same_process, socket_channel
from hidden_state_connector.engine.handoff.socket_channel import OrderListener, OrderSender
from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.metadata import SaveOrder
from hidden_state_connector.engine.scheduler_side import ERROR_PARAM, PATH_PARAM, SchedulerSide
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.format import (
    LockState,
    WriterLock,
    lock_path,
    probe,
    read_status,
    sample_metadata,
)
from hidden_state_reader.format.publish import SampleFileWriter

BLOCK_SIZE = 4
HS_GROUP = 1  # the hidden-state group is the second KV-cache group in these fakes
WAIT_S = 10.0  # generous bound for anything a thread must do


# -- scheduler half ---------------------------------------------------------------------


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
    return SchedulerSide(config, _vllm_config(engine_id), BLOCK_SIZE, HS_GROUP, WriteStats(0))


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


# -- write pipeline ---------------------------------------------------------------------

LAYERS, HIDDEN, NUM_BLOCKS = 3, 8, 12


@pytest.fixture(params=[1, 2], ids=["token-axis-1", "token-axis-2"])
def cache(request: pytest.FixtureRequest) -> tuple[torch.Tensor, CacheLayout]:
    """A hidden-state cache as the engine lays it out, filled with distinct values."""
    axis = request.param
    shape = (
        (NUM_BLOCKS, BLOCK_SIZE, LAYERS, HIDDEN)
        if axis == 1
        else (NUM_BLOCKS, LAYERS, BLOCK_SIZE, HIDDEN)
    )
    data = torch.randn(shape, generator=torch.Generator().manual_seed(axis))
    return data, CacheLayout(axis, BLOCK_SIZE, LAYERS, HIDDEN)


def _pipeline(cache: torch.Tensor, layout: CacheLayout, threads: int = 1) -> WritePipeline:
    extractor = Extractor(cache, layout, blocks_per_chunk=1, check_nonfinite=True)
    return WritePipeline(
        extractor,
        num_threads=threads,
        host_budget=extractor.slab_bytes,  # exactly one slab: one block in flight at a time
        when_full="wait",
        max_queued_bytes=1 << 30,
        checksum=True,
        check_nonfinite=True,
        fsync=False,
        stats=WriteStats(0),
    )


def _job(pipeline: WritePipeline, root: Path, req_id: str, block_ids: list[int], n: int) -> SaveJob:
    path = str(root / f"{req_id}.safetensors")
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    extractor = pipeline.extractor
    return SaveJob(
        req_id=req_id,
        path=path,
        token_ids=torch.arange(n, dtype=torch.int64) + 3,
        block_ids=block_ids,
        lock=WriterLock.create(path, dir_fd=dir_fd, request_id=req_id),
        dir_fd=dir_fd,  # the pipeline closes it
        metadata=sample_metadata(layer_ids=[1, 2, 4], request_id=req_id, num_prompt_tokens=n),
        chunks=extractor.plan(n),
        nbytes=n * extractor.token_bytes,
    )


def _gathered(
    cache: torch.Tensor, layout: CacheLayout, block_ids: list[int], n: int
) -> torch.Tensor:
    view = layout.blocks_tokens_layers(cache)
    return view[block_ids].reshape(-1, LAYERS, HIDDEN)[:n].clone()


def _read_all(root: Path, names: list[str]) -> dict[str, Any]:
    reader = HiddenStateReader(
        root, names=names, on_error="raise", lock_timeout=WAIT_S, verify_checksum=True
    )
    return {os.path.basename(s.path): s for s in reader}


def test_submitted_jobs_are_published_without_further_engine_calls(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path
) -> None:
    data, layout = cache
    pipeline = _pipeline(data, layout, threads=2)
    requests = {  # block tables out of order; partial last blocks; 7, 2 and 1 chunks
        "r0": ([9, 3, 0, 7, 11, 5, 2], 6 * BLOCK_SIZE + 3),
        "r1": ([4, 10], 2 * BLOCK_SIZE),
        "r2": ([6], 1),
    }
    try:
        jobs = [_job(pipeline, tmp_path, r, b, n) for r, (b, n) in requests.items()]
        assert len(jobs[0].chunks) == 7 and pipeline.pool.capacity == 1
        for job in jobs:
            pipeline.submit(job)  # as after_forward does; then the engine calls nothing
        # The reader sleeps on each lock until its writer publishes the file.
        samples = _read_all(tmp_path, [f"{r}.safetensors" for r in requests])
        assert sorted(samples) == [f"{r}.safetensors" for r in requests]
        for req_id, (blocks, n) in requests.items():
            sample = samples[f"{req_id}.safetensors"]
            assert torch.equal(sample.hidden_states, _gathered(data, layout, blocks, n))
            assert sample.token_ids.tolist() == list(range(3, n + 3))
            assert sample.layer_ids == [1, 2, 4]
            assert sample.metadata["nonfinite"] == "0"
            assert probe(lock_path(sample.path)) is LockState.FREE
        assert all(job.finished.wait(WAIT_S) for job in jobs)
        assert sorted(pipeline.finished()) == sorted(requests)  # reported once ...
        assert pipeline.finished() == []  # ... and only once
        assert pipeline.stats.total.files == 3 and pipeline.stats.total.failures == 0
        assert pipeline.pool.in_use == 0
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_flush_copies_everything_before_it_returns_so_blocks_may_be_reused(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path
) -> None:
    data, layout = cache
    pipeline = _pipeline(data, layout)
    blocks, n = [8, 1, 5, 2, 0, 11], 6 * BLOCK_SIZE - 1
    expected = _gathered(data, layout, blocks, n)
    try:
        job = _job(pipeline, tmp_path, "pre", blocks, n)
        pipeline.submit(job)
        pipeline.flush({"pre"}, timeout=60.0)  # waits on the one slab, chunk after chunk
        assert job.produced_all and job.failure is None
        data.fill_(float("nan"))  # the next forward pass reuses the freed blocks
        sample = _read_all(tmp_path, ["pre.safetensors"])["pre.safetensors"]
        assert torch.equal(sample.hidden_states, expected)
        assert sample.metadata["nonfinite"] == "0"
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_flush_fails_a_job_whose_writes_are_blocked_after_the_timeout(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, layout = cache
    entered, release = threading.Event(), threading.Event()
    real_write = SampleFileWriter.write_hidden

    def blocked_write(self: SampleFileWriter, chunk: Any) -> None:  # the fault: a stuck disk
        entered.set()
        release.wait(WAIT_S)
        real_write(self, chunk)

    monkeypatch.setattr(SampleFileWriter, "write_hidden", blocked_write)
    pipeline = _pipeline(data, layout)
    try:
        job = _job(pipeline, tmp_path, "stuck", [3, 4, 5, 6, 7], 5 * BLOCK_SIZE)
        pipeline.submit(job)
        assert entered.wait(WAIT_S)  # the writer holds the only slab and cannot return it
        pipeline.flush({"stuck"}, timeout=0.2)
        assert job.failure is not None and "preempted" in job.failure
        assert job.produced_all  # its chunk stream is ended: the writer will not wait
        release.set()
        assert job.finished.wait(WAIT_S)
        status = read_status(lock_path(job.path))
        assert status.failed and "preempted" in status.reason
        assert probe(lock_path(job.path)) is LockState.FREE
        assert not os.path.exists(job.path)
        assert [f for f in os.listdir(tmp_path) if ".tmp." in f] == []
        assert pipeline.finished() == ["stuck"]  # reported, so vLLM frees its blocks
        assert pipeline.stats.total.failures == 1 and pipeline.stats.total.files == 0
    finally:
        release.set()
        assert pipeline.close(WAIT_S) == 0


# -- order channel ----------------------------------------------------------------------


class _Inbox:
    """``accept`` of an ``OrderListener``: collects orders, wakes waiters."""

    def __init__(self) -> None:
        self.orders: list[SaveOrder] = []
        self._cond = threading.Condition()

    def __call__(self, order: SaveOrder) -> None:
        with self._cond:
            self.orders.append(order)
            self._cond.notify_all()

    def wait_for(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.orders) >= count, WAIT_S)


def _order(req_id: str) -> SaveOrder:
    return SaveOrder(req_id, f"/data/{req_id}.safetensors", [1, 2, 3], [7, 4], 2, None, False)


@pytest.fixture
def engine_key() -> str:
    return f"unit-{uuid.uuid4().hex}/0"


def test_order_channel_round_trip(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    sender = OrderSender(engine_key)
    try:
        sent = [_order("a"), SaveOrder("b", "/data/b.safetensors", [], [], 0, "aborted", True)]
        assert all(sender.send(o) for o in sent)
        assert inbox.wait_for(2)
        assert inbox.orders == sent  # one connection: in order, fields intact
    finally:
        sender.close()
        listener.close()


def test_order_channel_refuses_clients_without_the_engine_key(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    address = socket_channel._address(engine_key)
    try:
        with pytest.raises(AuthenticationError):
            Client(address, "AF_UNIX", authkey=b"not the engine's key")
        # A raw client that skips the handshake and writes a framed order at once.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(address)
        payload = b'{"req_id":"evil","path":"/x.safetensors","token_ids":[1],"block_ids":[0],'
        payload += b'"num_prompt_tokens":1}'
        raw.sendall(struct.pack("!i", len(payload)) + payload)
        # Connections are accepted one after the other: once a real sender's order has
        # arrived, the two refused clients have been dealt with.
        sender = OrderSender(engine_key)
        assert sender.send(_order("good"))
        assert inbox.wait_for(1)
        assert [o.req_id for o in inbox.orders] == ["good"]
        sender.close()
        raw.close()
    finally:
        listener.close()


def test_order_sender_returns_false_when_nobody_listens(engine_key: str) -> None:
    sender = OrderSender(engine_key)
    assert sender.send(_order("a")) is False
    assert sender.send(_order("b")) is False  # and again, without retrying the socket


def test_order_sender_returns_false_after_the_listener_closed(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    listener.close()
    sender = OrderSender(engine_key)
    try:
        delivered = sender.send(_order("late"))
        accepted = inbox.wait_for(1) if delivered else False
        assert not delivered, f"sent after close; handed to accept() after close: {accepted}"
        assert inbox.orders == []
    finally:
        sender.close()
