"""``SchedulerSide``, ``WorkerSide`` and ``WritePipeline`` against small fakes; no vLLM.

In the style of vLLM's offloading-connector unit tests: fake request objects and
scheduler outputs (``SimpleNamespace`` with the fields vLLM's ``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData`` and ``Request`` have), a fake hidden-state
cache (a CPU tensor), real files in ``tmp_path``, read back with
``hidden_state_reader``. The few ``compat`` functions that ask vLLM itself (the version,
the cache-only layer's name, the TP rank, the request status type) are replaced.
Mocks only inject faults (a full disk, a stuck disk).

The fake engine calls the connector's halves in vLLM's order (0.32, with the drafter
deferring the finalize): ``build_metadata`` (scheduler), ``before_forward``
(``handle_preemptions``), the forward pass (here: the cache already holds the values),
``get_finished`` with the ids the scheduler announced finished in the step before, then
``after_forward`` (``wait_for_save``).
"""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from disk_faults import StuckDisk
from engine_fakes import finished_request, new_request, scheduler_output

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import CapturePlan, scheduler_side, worker_side
from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.scheduler_side import ERROR_PARAM, PATH_PARAM
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import JobState, SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_reader import HiddenStateReader, LoadOptions, load_sample, read_header
from hidden_state_reader.files.locks import SharedLock, WriterLock, probe, read_status
from hidden_state_reader.files.publish import SampleFileWriter
from hidden_state_reader.format import LockState, Meta, lock_path, sample_metadata
from hidden_state_reader.kernels.fp8 import quantize

BLOCK, LAYERS, HIDDEN, NUM_BLOCKS = 4, 3, 8, 16
HS_GROUP = 1  # the hidden-state group is the second KV-cache group in these fakes
LAYER_IDS = [1, 2, 4]
BLOCK_BYTES = BLOCK * LAYERS * HIDDEN * 4  # float32
WAIT_S = 10.0  # generous bound for anything a thread must do


# -- fakes --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_vllm_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``compat`` calls that ask vLLM itself, answered as a 0.32 engine would."""
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(compat, "tensor_parallel_rank", lambda: 0)
    monkeypatch.setattr(compat, "find_cache_only_layer", lambda _cfg, caches: next(iter(caches)))
    monkeypatch.setattr(compat, "request_was_aborted", lambda request: request.status == "aborted")


@pytest.fixture(params=[1, 2], ids=["token-axis-1", "token-axis-2"])
def cache(request: pytest.FixtureRequest) -> torch.Tensor:
    """The cache-only layer's view, in either vLLM layout, filled with distinct values."""
    shape = (
        (NUM_BLOCKS, BLOCK, LAYERS, HIDDEN)
        if request.param == 1
        else (NUM_BLOCKS, LAYERS, BLOCK, HIDDEN)
    )
    return torch.randn(shape, generator=torch.Generator().manual_seed(request.param))


def _gathered(cache: torch.Tensor, block_ids: list[int], n: int) -> torch.Tensor:
    """What the file must hold: the first ``n`` token positions of these blocks."""
    view = cache if cache.shape[1] == BLOCK else cache.transpose(1, 2)
    return view[block_ids].reshape(-1, LAYERS, HIDDEN)[:n].clone()


class FakeEngine:
    """Both halves of one engine in one process, driven in vLLM's call order."""

    def __init__(
        self, root: Path, cache: torch.Tensor, stats: WriteStats | None = None, **extra: Any
    ) -> None:
        settings: dict[str, Any] = {
            "chunk_bytes": BLOCK_BYTES,  # one block per chunk
            "host_buffer_bytes": BLOCK_BYTES,  # one slab: one chunk in flight at a time
            "num_writer_threads": 1,
            "checksum": True,
            "shutdown_timeout": 5.0,
        }
        settings.update(extra)
        self.config = ConnectorConfig(shared_storage_path=str(root), instance_id="unit", **settings)
        # A fresh engine id per test: no other test's hand-off or channel is found.
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="fake-model"),
            kv_transfer_config=SimpleNamespace(engine_id=f"unit-{uuid.uuid4().hex}"),
            parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
        )
        self.stats = stats if stats is not None else WriteStats(0)
        self.scheduler = scheduler_side(
            self.config, self.vllm_config, CapturePlan(HS_GROUP, BLOCK), self.stats
        )
        self.worker = worker_side(
            self.config, self.vllm_config, CapturePlan(HS_GROUP, BLOCK, LAYER_IDS), self.stats
        )
        self.worker.register({"model.drafter.cache_only": cache})
        self.announced: set[str] = set()  # finished in the last step; told the worker next

    def step(self, output: SimpleNamespace, after_preemption: Any = None) -> set[str]:
        """One engine step; returns the requests whose blocks vLLM may free now."""
        meta = self.scheduler.build_metadata(output)
        self.worker.before_forward(meta)
        if after_preemption is not None:
            after_preemption()  # the forward pass may overwrite the freed blocks now
        # With extract_hidden_states, vLLM finalizes after the drafter: get_finished
        # (get_transfer_results) comes before wait_for_save.
        finished, self.announced = self.announced, set()
        done, _ = self.worker.get_finished(meta, finished)
        self.worker.after_forward(meta)
        return done or set()

    def finish(self, request: SimpleNamespace, block_ids: list[int]) -> dict[str, Any]:
        """``request_finished``: the scheduler keeps the blocks until the worker reports."""
        delay, params = self.scheduler.request_finished(request, block_ids)
        assert delay is True, params
        self.announced.add(request.request_id)
        assert params is not None
        return params

    def idle_until_freed(self, req_id: str) -> None:
        """Empty steps until ``req_id`` is reported (its copies are done)."""
        assert self.worker.pipeline is not None
        assert self.worker.pipeline.wait_copied(req_id, WAIT_S), f"{req_id} never copied"
        assert req_id in self.step(scheduler_output()), f"{req_id} not reported"

    def close(self) -> None:
        """Shut both halves down (once): writer threads finish their jobs and stop."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Any]:
    engines: list[FakeEngine] = []

    def make(cache: torch.Tensor, stats: WriteStats | None = None, **extra: Any) -> FakeEngine:
        engines.append(FakeEngine(tmp_path, cache, stats, **extra))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def _read(path: str) -> Any:
    reader = HiddenStateReader(
        os.path.dirname(path),
        names=[os.path.basename(path)],
        on_error="raise",
        lock_timeout=WAIT_S,
        verify_checksum=True,
    )
    (sample,) = list(reader)
    return sample


def _temp_files(root: Path) -> list[str]:
    return [f for f in os.listdir(root) if ".tmp." in f]


# -- scheduler side + worker side ------------------------------------------------------


@pytest.mark.parametrize("include_output", [False, True], ids=["prompt", "with-output"])
def test_a_finished_requests_save_publishes_a_complete_readable_file(
    cache: torch.Tensor, engine_factory: Any, tmp_path: Path, include_output: bool
) -> None:
    engine = engine_factory(cache, include_output_tokens=include_output)
    prompt, output, blocks = list(range(10, 20)), [7, 8, 9], [5, 2, 9, 0]
    request = new_request("req-a", prompt, blocks)
    assert engine.step(scheduler_output(new=(request,), scheduled={"req-a": len(prompt)})) == set()
    params = engine.finish(finished_request("req-a", prompt, output), blocks)
    path = params[PATH_PARAM]
    assert ERROR_PARAM not in params and path.startswith(str(tmp_path))

    sample = _read(path)  # sleeps on the lock until the writer publishes
    saved = prompt + output[:-1] if include_output else prompt
    assert sample.token_ids.tolist() == saved
    assert torch.equal(sample.hidden_states, _gathered(cache, blocks, len(saved)))
    assert sample.layer_ids == LAYER_IDS
    engine.idle_until_freed("req-a")
    # The writer counts a sample after releasing its lock: shutting down joins the writer
    # threads, so the counters are final afterwards. (A small published file is read
    # without its lock, which its writer may still hold for an instant: probe it now.)
    engine.close()
    assert probe(lock_path(path)) is LockState.FREE
    assert engine.stats.total.files == 1 and engine.stats.total.failures == 0


def test_blocks_are_reported_freed_only_after_the_copy(
    cache: torch.Tensor, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = StuckDisk(monkeypatch)
    engine = engine_factory(cache, include_output_tokens=True)
    prompt, output, blocks = list(range(12)), [1], [3, 4, 5]  # 3 chunks, 1 slab
    assert (
        engine.step(scheduler_output(new=(new_request("r", prompt, blocks),), scheduled={"r": 12}))
        == set()
    )
    engine.finish(finished_request("r", prompt, output), blocks)  # hand-off: copy starts
    assert disk.entered.wait(WAIT_S)  # the writer holds the only slab: chunks 2-3 wait
    for _ in range(3):  # announced finished, but its blocks still hold uncopied states
        assert engine.step(scheduler_output()) == set()
        engine.announced.add("r")
    disk.release.set()
    engine.idle_until_freed("r")
    sample = _read(engine.scheduler.default_path("r"))
    assert torch.equal(sample.hidden_states, _gathered(cache, blocks, len(prompt)))


def test_a_failed_write_records_why_in_the_lock_and_leaves_no_partial_file(
    cache: torch.Tensor, engine_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = StuckDisk(monkeypatch, error=OSError(errno.ENOSPC, "No space left on device"))
    engine = engine_factory(cache)
    prompt, blocks = list(range(9)), [1, 6, 11]
    engine.step(scheduler_output(new=(new_request("full", prompt, blocks),), scheduled={"full": 9}))
    path = engine.finish(finished_request("full", prompt, [0]), blocks)[PATH_PARAM]
    assert disk.entered.wait(WAIT_S)
    engine.idle_until_freed("full")  # a failed sample still frees its blocks
    held = SharedLock.acquire(path, timeout=WAIT_S)  # sleeps until the writer lets go
    assert held is not None and held.existed
    held.release()
    status = read_status(lock_path(path))
    assert status.failed and "write failed" in status.reason and "No space" in status.reason
    assert not os.path.exists(path)
    assert _temp_files(tmp_path) == []
    engine.close()  # joins the writer threads: the failure is counted after the release
    assert engine.stats.total.failures == 1 and engine.stats.total.files == 0


class _FailureSeen(WriteStats):
    """Counters that signal the first sample failure (the writer counts it after the lock)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.seen = threading.Event()

    def failure(self, req_id: str, path: str, reason: str, *, dropped: bool = False) -> None:
        super().failure(req_id, path, reason, dropped=dropped)
        self.seen.set()


def test_a_write_that_failed_before_the_request_finished_is_told_in_the_response(
    cache: torch.Tensor, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt-only save fails while the request still decodes: its response says why."""
    StuckDisk(monkeypatch, error=OSError(errno.ENOSPC, "No space left on device"))
    stats = _FailureSeen()
    engine = engine_factory(cache, stats=stats)
    prompt, blocks = list(range(9)), [1, 6, 11]
    engine.step(scheduler_output(new=(new_request("p", prompt, blocks),), scheduled={"p": 9}))
    assert stats.seen.wait(WAIT_S), "the prompt's save never failed"
    params = engine.finish(finished_request("p", prompt, [0, 1, 2]), blocks)
    assert "No space left on device" in params[ERROR_PARAM]
    engine.idle_until_freed("p")


def test_a_preempted_requests_states_are_copied_out_before_the_next_forward_pass(
    cache: torch.Tensor, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = SampleFileWriter.write_hidden

    def slow_write(writer: SampleFileWriter, chunk: Any) -> None:  # a slow disk
        time.sleep(0.02)
        real(writer, chunk)

    monkeypatch.setattr(SampleFileWriter, "write_hidden", slow_write)
    engine = engine_factory(cache)
    prompt, blocks = list(range(20)), [15, 3, 8, 0, 12]  # 5 chunks through 1 slab
    expected = _gathered(cache, blocks, len(prompt))
    new = new_request("pre", prompt, blocks)
    engine.step(
        scheduler_output(new=(new,), scheduled={"pre": 20})
    )  # prompt complete: save started
    # Preempted before it finished: vLLM freed its blocks; this step may reuse them.
    engine.step(
        scheduler_output(preempted=frozenset({"pre"})),
        after_preemption=lambda: cache.fill_(float("nan")),
    )
    path = engine.scheduler.default_path("pre")
    sample = _read(path)
    assert torch.equal(sample.hidden_states, expected)
    assert sample.metadata["nonfinite"] == "0"


# -- loss masks (kv_transfer_params) -------------------------------------------------


@pytest.mark.parametrize(
    ("include_output", "params", "expected"),
    [
        (False, {"loss_mask": [0] * 4 + [1] * 6}, [0] * 4 + [1] * 6),
        (False, {"loss_mask_spans": [[7, 10], [2, 4]]}, [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]),
        # Generated tokens are stored too: a prompt-length mask marks them 1 ...
        (True, {"loss_mask_spans": [[8, 10]]}, [0] * 8 + [1] * 4),
        # ... a full-length one is taken exactly.
        (True, {"loss_mask": [1] * 10 + [0, 1]}, [1] * 10 + [0, 1]),
    ],
    ids=["prompt-list", "prompt-spans", "output-spans", "output-full-list"],
)
def test_a_clients_loss_mask_is_stored_with_the_sample(
    cache: torch.Tensor,
    engine_factory: Any,
    include_output: bool,
    params: dict[str, Any],
    expected: list[int],
) -> None:
    engine = engine_factory(cache, include_output_tokens=include_output)
    prompt, output, blocks = list(range(10, 20)), [7, 8, 9], [5, 2, 9, 0]
    request = new_request("m", prompt, blocks, params)
    engine.step(scheduler_output(new=(request,), scheduled={"m": len(prompt)}))
    result = engine.finish(finished_request("m", prompt, output), blocks)
    assert ERROR_PARAM not in result
    sample = _read(result[PATH_PARAM])
    assert sample.loss_mask is not None and sample.loss_mask.int().tolist() == expected
    assert len(expected) == sample.num_tokens


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"loss_mask": [1] * 9}, "loss_mask has 9 entries; expected one per stored token"),
        ({"loss_mask": [1] * 9 + [2]}, "loss_mask[9] is 2; every entry must be 0 or 1"),
        ({"loss_mask": "1111111111"}, "loss_mask must be a list of 0/1, got str"),
        ({"loss_mask_spans": [[3, 11]]}, "loss_mask_spans[0] is [3, 11]; need 0 <= start"),
        ({"loss_mask": [1] * 10, "loss_mask_spans": []}, "send either loss_mask or"),
    ],
    ids=["short", "two", "string", "span-past-end", "both"],
)
def test_a_bad_loss_mask_is_refused_on_arrival_and_the_engine_keeps_writing(
    cache: torch.Tensor, engine_factory: Any, params: dict[str, Any], reason: str
) -> None:
    engine = engine_factory(cache)
    prompt, blocks = list(range(10)), [1, 6, 11]
    bad = new_request("bad", prompt, blocks, params)
    good = new_request("good", prompt, [2, 3, 4], {"loss_mask": [1] * 10})
    engine.step(scheduler_output(new=(bad, good), scheduled={"bad": 10, "good": 10}))
    keep, result = engine.scheduler.request_finished(finished_request("bad", prompt, [0]), blocks)
    assert keep is False and result is not None  # nothing held: blocks freed at once
    assert reason in result[ERROR_PARAM]
    assert not os.path.lexists(result[PATH_PARAM])
    assert not os.path.lexists(lock_path(result[PATH_PARAM]))  # refused before any lock
    path = engine.finish(finished_request("good", prompt, [0]), [2, 3, 4])[PATH_PARAM]
    sample = _read(path)
    assert sample.loss_mask is not None and bool(sample.loss_mask.all())


def test_a_full_length_mask_that_misses_the_generated_count_fails_at_the_end(
    cache: torch.Tensor, engine_factory: Any
) -> None:
    engine = engine_factory(cache, include_output_tokens=True)
    prompt, blocks = list(range(10)), [1, 6, 11, 3]
    request = new_request("long", prompt, blocks, {"loss_mask": [1] * 13})
    engine.step(scheduler_output(new=(request,), scheduled={"long": 10}))
    result = engine.finish(finished_request("long", prompt, [5, 6, 7]), blocks)  # 12 stored
    assert "loss_mask has 13 entries but 12 tokens are stored" in result[ERROR_PARAM]
    engine.idle_until_freed("long")  # the failed sample still frees its blocks
    status = read_status(lock_path(result[PATH_PARAM]))
    assert status.failed and "13 entries" in status.reason
    assert not os.path.exists(result[PATH_PARAM])


# -- write pipeline ------------------------------------------------------------------


def _pipeline(cache: torch.Tensor, **overrides: Any) -> WritePipeline:
    axis = 1 if cache.shape[1] == BLOCK else 2
    extractor = Extractor(
        cache, CacheLayout(axis, BLOCK, LAYERS, HIDDEN), blocks_per_chunk=1, check_nonfinite=True
    )
    settings: dict[str, Any] = {
        "num_threads": 1,
        "host_budget": extractor.slab_bytes,
        "when_full": "wait",
        "max_queued_bytes": 1 << 30,
        "checksum": False,
        "check_nonfinite": True,
        "fsync": False,
        "stats": WriteStats(0),
    }
    settings.update(overrides)
    return WritePipeline(extractor, **settings)


def _job(pipeline: WritePipeline, root: Path, req_id: str, blocks: list[int]) -> SaveJob:
    path = str(root / f"{req_id}.safetensors")
    n = len(blocks) * BLOCK
    return SaveJob(
        req_id=req_id,
        path=path,
        token_ids=torch.arange(n, dtype=torch.int64),
        block_ids=blocks,
        lock=WriterLock.create(path, request_id=req_id),
        dir_fd=None,
        metadata=sample_metadata(layer_ids=LAYER_IDS, request_id=req_id, num_prompt_tokens=n),
        chunks=pipeline.extractor.plan(n),
        nbytes=n * pipeline.extractor.token_bytes,
    )


def test_job_states_published_and_dropped(cache: torch.Tensor, tmp_path: Path) -> None:
    pipeline = _pipeline(cache, when_full="drop", max_queued_bytes=2 * BLOCK_BYTES)
    try:
        ok = _job(pipeline, tmp_path, "ok", [1, 2])
        too_big = _job(pipeline, tmp_path, "big", [3, 4, 5])
        assert ok.state is JobState.QUEUED
        pipeline.submit(ok)
        pipeline.submit(too_big)
        assert ok.finished.wait(WAIT_S) and too_big.finished.is_set()
        assert ok.state is JobState.PUBLISHED and ok.published and ok.failure is None
        assert too_big.state is JobState.FAILED and not too_big.published
        status = read_status(lock_path(too_big.path))
        assert status.failed and "dropped" in status.reason
        assert not os.path.exists(too_big.path)
        assert sorted(pipeline.finished()) == ["big", "ok"]
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_shutdown_fails_unwritten_jobs_with_the_reason_in_their_locks(
    cache: torch.Tensor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = StuckDisk(monkeypatch)
    pipeline = _pipeline(cache)
    first, second = (
        _job(pipeline, tmp_path, "first", [1, 2]),
        _job(pipeline, tmp_path, "second", [3]),
    )
    pipeline.submit(first)
    pipeline.submit(second)  # queued behind the stuck one: the only writer thread is busy
    assert disk.entered.wait(WAIT_S)
    threading.Timer(0.3, disk.release.set).start()  # the disk recovers after the deadline
    assert pipeline.close(timeout=0.1) == 2
    for job in (first, second):
        assert job.finished.wait(WAIT_S)
        assert job.state is JobState.FAILED
        status = read_status(lock_path(job.path))
        assert status.failed and "shut down" in status.reason
        assert not os.path.exists(job.path)
    assert _temp_files(tmp_path) == []


# -- fp8 storage ----------------------------------------------------------------------


def _fp8_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """docs/format.md's per-element bound of a dequantized value (before output rounding)."""
    return 2**-4 * x.abs() + 2**-10 * scales


def test_fp8_storage_writes_each_chunks_quantized_rows_and_their_scales(
    cache: torch.Tensor, engine_factory: Any
) -> None:
    engine = engine_factory(cache, storage_dtype="fp8_e4m3")
    prompt, blocks = list(range(10, 24)), [5, 2, 9, 0]  # 14 tokens: 4 chunks, the last partial
    engine.step(scheduler_output(new=(new_request("q", prompt, blocks),), scheduled={"q": 14}))
    path = engine.finish(finished_request("q", prompt, [0]), blocks)[PATH_PARAM]
    sample = _read(path)  # checksum verified: the scales are covered, in file order
    expected = _gathered(cache, blocks, len(prompt))
    header = read_header(path)
    assert header.hidden.dtype == "F8_E4M3" and header.metadata[Meta.MODEL_DTYPE] == "F32"
    assert sample.hidden_states.dtype == torch.float32  # the fake cache's (model) dtype
    raw = load_sample(path, LoadOptions(raw_fp8=True))
    q, scales = quantize(expected)  # rows are independent: chunking changes nothing
    assert torch.equal(raw.hidden_states.view(torch.uint8), q.view(torch.uint8))
    assert raw.hidden_states_scales is not None and torch.equal(raw.hidden_states_scales, scales)
    err = (sample.hidden_states - expected).abs()
    assert bool((err <= _fp8_bound(expected, scales)).all())
    engine.idle_until_freed("q")


def test_bad_storage_dtype_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage_dtype: must be one of model, fp8_e4m3"):
        ConnectorConfig.from_extra_config(
            {"shared_storage_path": str(tmp_path), "storage_dtype": "fp8"}
        )


@pytest.fixture(scope="module")
def captured_states(tiny_model_bf16: Path) -> torch.Tensor:
    """Hidden states of the suite's tiny Llama (HF transformers, bf16), layers LAYER_IDS."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_bf16, dtype=torch.bfloat16).eval()
    text = b"The quick brown fox jumps over the lazy dog; fp8 halves the bytes on disk."
    tokens = torch.tensor(list(text[: NUM_BLOCKS * BLOCK]))
    with torch.no_grad():
        out = model(tokens[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in LAYER_IDS], dim=1)  # [T, L, 128]


def test_fp8_round_trip_of_real_captured_states_is_within_the_bound(
    captured_states: torch.Tensor, engine_factory: Any
) -> None:
    states = captured_states
    hidden = states.shape[-1]
    cache = states.reshape(NUM_BLOCKS, BLOCK, LAYERS, hidden).contiguous()  # blocks 0..15
    block_bytes = BLOCK * LAYERS * hidden * 2
    engine = engine_factory(
        cache, storage_dtype="fp8_e4m3", chunk_bytes=block_bytes, host_buffer_bytes=block_bytes
    )
    blocks = list(range(NUM_BLOCKS))
    prompt = list(range(NUM_BLOCKS * BLOCK - 1))  # the last position is a generated token
    engine.step(
        scheduler_output(
            new=(new_request("real", prompt, blocks),), scheduled={"real": len(prompt)}
        )
    )
    path = engine.finish(finished_request("real", prompt, [0]), blocks)[PATH_PARAM]
    sample = _read(path)
    expected = states[: len(prompt)].float()
    assert sample.hidden_states.dtype == torch.bfloat16  # the model's dtype, recorded
    got = sample.hidden_states.float()
    scales = load_sample(path, LoadOptions(raw_fp8=True)).hidden_states_scales
    assert scales is not None
    limit = _fp8_bound(expected, scales) + 2**-8 * got.abs()  # + bf16 rounding of the result
    assert bool(((got - expected).abs() <= limit).all())
    per_layer = (got - expected).norm(dim=(0, 2)) / expected.norm(dim=(0, 2))
    assert bool((per_layer < 2**-4).all()), per_layer.tolist()
    engine.idle_until_freed("real")


def test_a_shut_down_worker_is_freed_with_its_buffers(
    cache: torch.Tensor, engine_factory: Any
) -> None:
    # Nothing process-wide (exit hook, hand-off, order channel) keeps a worker that shut
    # down: an application that builds engine after engine gets each one's memory back.
    engine = engine_factory(cache)
    engine.step(scheduler_output())
    worker = weakref.ref(engine.worker)
    engine.close()
    del engine.worker
    gc.collect()
    assert worker() is None
