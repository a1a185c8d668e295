"""The write path (``engine/write/``) without an engine: pipeline, chunk plan, slab pool.

The write pipeline gets a real CPU tensor as its hidden-state cache and real files in
``tmp_path``. Mocks only inject faults (a blocked disk write).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.buffers import SlabPool
from hidden_state_connector.engine.write.gather import Extractor, plan_chunks
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_connector.engine.write.sample_file import (
    PRODUCTION_HOOKS,
    FileOptions,
    WriteHooks,
)
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import WriterLock, probe, read_status
from hidden_state_reader.files.publish import SampleFileWriter
from hidden_state_reader.format import LockState, lock_path, sample_metadata

BLOCK_SIZE = 4
WAIT_S = 10.0  # generous bound for anything a thread must do


LAYERS, HIDDEN, NUM_BLOCKS = 3, 8, 12
LAYER_IDS = [1, 2, 4]  # what the jobs' metadata records


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


def _pipeline(
    cache: torch.Tensor,
    layout: CacheLayout,
    threads: int = 1,
    layer_ids: list[int] = LAYER_IDS,
    hooks: WriteHooks = PRODUCTION_HOOKS,
) -> WritePipeline:
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
        layer_ids=layer_ids,
        hooks=hooks,
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
        metadata=sample_metadata(layer_ids=LAYER_IDS, request_id=req_id, num_prompt_tokens=n),
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
        # A small published file is read without its lock (docs/format.md, "Files
        # published by rename"): the writer may release it just after the read.
        assert all(job.finished.wait(WAIT_S) for job in jobs)
        assert all(probe(lock_path(job.path)) is LockState.FREE for job in jobs)
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


# -- chunk plan (gather) and slab pool (buffers) -------------------------------------


def test_chunk_plan_covers_every_token_once() -> None:
    chunks = plan_chunks(num_tokens=100, block_size=16, blocks_per_chunk=3)
    assert [(c.start, c.stop) for c in chunks] == [(0, 48), (48, 96), (96, 100)]
    assert [c.count for c in chunks] == [3, 3, 1]
    assert plan_chunks(0, 16, 3) == []


def test_slab_pool_is_bounded_and_reuses_slabs() -> None:
    pool = SlabPool(1024, 3 * 1024 + 10, pinned=False)
    pool.preallocate()
    slabs = [pool.try_acquire() for _ in range(3)]
    assert all(s is not None for s in slabs)
    assert pool.try_acquire() is None
    pool.release(slabs[0])  # type: ignore[arg-type]
    again = pool.try_acquire()
    assert again is slabs[0]
    assert pool.allocated_bytes == 3 * 1024


# -- the guard against silent wrong data (row_guard) ---------------------------------


def _assert_failed_loudly(pipeline: WritePipeline, job: SaveJob, words: str) -> None:
    """No file, the lock released as failed with the reason, counted, reported finished."""
    assert job.finished.wait(WAIT_S)
    status = read_status(lock_path(job.path))
    assert status.failed and words in status.reason, status.reason
    assert probe(lock_path(job.path)) is LockState.FREE
    assert not os.path.exists(job.path)
    assert [f for f in os.listdir(os.path.dirname(job.path)) if ".tmp." in f] == []
    assert pipeline.finished() == [job.req_id]  # reported, so vLLM frees its blocks
    assert pipeline.stats.total.failures == 1 and pipeline.stats.total.files == 0


@pytest.mark.parametrize("zero", [0.0, -0.0], ids=["plus-zero", "minus-zero"])
def test_a_sample_with_an_all_zero_row_is_failed_not_published(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path, zero: float
) -> None:
    # What vLLM leaves when it never stores a layer (one layer of one token here: the
    # fault seen upstream is a whole layer or a whole sample).
    data, layout = cache
    blocks, n = [2, 7, 4], 3 * BLOCK_SIZE - 1
    view = layout.blocks_tokens_layers(data)
    view[7, 1, 2].fill_(zero)  # token BLOCK_SIZE + 1, layer position 2 (layer id 4)
    view[7, 1, 0, 0] = 0.0  # a zero first element alone is a real value
    pipeline = _pipeline(data, layout)
    try:
        job = _job(pipeline, tmp_path, "zeros", blocks, n)
        pipeline.submit(job)
        _assert_failed_loudly(pipeline, job, f"token {BLOCK_SIZE + 1} at layer 4 are all zero")
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_zero_embeddings_rows_are_real_values(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path
) -> None:
    # Layer id 0 is the embedding table's row, which may be zero (padding_idx).
    data, layout = cache
    layout.blocks_tokens_layers(data)[5, 0, 0].zero_()
    pipeline = _pipeline(data, layout, layer_ids=[0, 2, 4])
    try:
        job = _job(pipeline, tmp_path, "emb", [5], BLOCK_SIZE)
        pipeline.submit(job)
        sample = _read_all(tmp_path, ["emb.safetensors"])["emb.safetensors"]
        assert torch.equal(sample.hidden_states, _gathered(data, layout, [5], BLOCK_SIZE))
        assert not sample.hidden_states[0, 0].any()
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_a_sample_with_fewer_blocks_than_its_tokens_need_is_failed(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path
) -> None:
    # Its last rows would come from whatever the slab held before: never published.
    data, layout = cache
    pipeline = _pipeline(data, layout)
    try:
        job = _job(pipeline, tmp_path, "short", [3, 4], 2 * BLOCK_SIZE + 1)
        pipeline.submit(job)
        _assert_failed_loudly(pipeline, job, "2 blocks cannot hold tokens")
    finally:
        assert pipeline.close(WAIT_S) == 0


def test_rows_must_add_up_to_the_token_ids() -> None:
    from hidden_state_connector.engine.write.row_guard import RowCounter

    rows = RowCounter(10)
    assert rows.add(0, 4) is None and rows.add(4, 8) is None
    assert rows.missing() == (
        "8 rows of hidden states were captured for 10 token ids; the sample is not published"
    )
    assert "do not follow the 8 rows" in (rows.add(9, 10) or "")
    assert "within 10 token ids" in (RowCounter(10).add(0, 11) or "")
    assert RowCounter(3).add(0, 3) is None


def test_injected_write_hooks_see_every_gathered_chunk_and_create_every_writer(
    cache: tuple[torch.Tensor, CacheLayout], tmp_path: Path
) -> None:
    """The seams benchmarks use: ``write_sample`` (drop the data) and ``writer_factory``."""
    data, layout = cache
    drained: dict[str, list[torch.Tensor]] = {}

    def drain(job: SaveJob, extractor: Extractor, options: FileOptions, return_slab: Any,
              copies_done: Any) -> str | None:  # fmt: skip
        while (item := job.ready.get()) is not None:
            chunk, slab = item
            rows = extractor.chunk_bytes(slab, chunk).clone().view(data.dtype)
            drained.setdefault(job.req_id, []).append(rows.reshape(-1, LAYERS, HIDDEN))
            return_slab(slab)
        copies_done()
        assert job.lock is not None
        job.lock.release()
        return None

    requests = {"r0": ([9, 3, 0], 2 * BLOCK_SIZE + 1), "r1": ([4], 2)}
    pipeline = _pipeline(data, layout, threads=2, hooks=WriteHooks(write_sample=drain))
    try:
        jobs = [_job(pipeline, tmp_path, r, b, n) for r, (b, n) in requests.items()]
        for job in jobs:
            pipeline.submit(job)
        assert all(job.finished.wait(WAIT_S) for job in jobs)
        for req_id, (blocks, n) in requests.items():
            assert torch.equal(torch.cat(drained[req_id]), _gathered(data, layout, blocks, n))
        assert not list(tmp_path.glob("*.safetensors"))  # nothing written ...
        assert pipeline.stats.total.files == 2 and pipeline.pool.in_use == 0  # ... all counted
    finally:
        assert pipeline.close(WAIT_S) == 0

    created: list[str] = []

    class CountedWriter(SampleFileWriter):
        def __init__(self, path: str, **kwargs: Any) -> None:
            created.append(os.path.basename(path))
            super().__init__(path, **kwargs)

    pipeline = _pipeline(data, layout, hooks=WriteHooks(writer_factory=CountedWriter))
    try:
        assert pipeline.file_options.writer_factory is CountedWriter
        jobs = [_job(pipeline, tmp_path, r, b, n) for r, (b, n) in requests.items()]
        for job in jobs:
            pipeline.submit(job)
        samples = _read_all(tmp_path, [f"{r}.safetensors" for r in requests])
        assert sorted(created) == sorted(samples) == ["r0.safetensors", "r1.safetensors"]
    finally:
        assert pipeline.close(WAIT_S) == 0
