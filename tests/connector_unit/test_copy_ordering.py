"""Copies wait for the rows they read: the GPU ordering rule, kept on the CPU.

On CUDA the model writes the hidden-state cache on its stream and the connector copies
out on its own stream; a copy sees the model's writes only once its stream has waited
for them (``Extractor.begin_step`` / ``begin_off_thread``). The CPU build executes
every write at once, so the CPU suite cannot see a copy that skipped its wait.
``StreamOrderedExtractor`` keeps the GPU's rule on the CPU: the model's writes stay
pending until the copy stream waits for them, so a copy issued too early reads what the
blocks held before (zeros of a fresh block here), exactly what an H100 published
(issue 35).

The pipeline is real (threads, slabs, files, the reader); the one injected fault is a
disk write that waits until released (``disk_faults.StuckDisk``), which makes a writer thread
return its slab at the moment the test chooses.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_faults import StuckDisk

from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.buffers import Slab
from hidden_state_connector.engine.write.gather import Chunk, Extractor
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import WriterLock, read_status
from hidden_state_reader.format import sample_metadata

BLOCK, LAYERS, HIDDEN, NUM_BLOCKS = 4, 3, 8, 8
LAYER_IDS = [1, 2, 4]
WAIT_S = 10.0  # generous bound for anything a thread must do


class StreamOrderedExtractor(Extractor):
    """A CPU ``Extractor`` whose copies see only the model writes their stream waited for.

    ``model_write`` is the model's stream: it records a write without applying it.
    ``mark_step`` is the event recorded after a step; ``begin_step`` waits for the
    model's stream as it is now, ``begin_off_thread`` for the last marked step.
    """

    def __init__(self, cache: torch.Tensor, layout: CacheLayout) -> None:
        super().__init__(cache, layout, blocks_per_chunk=1, check_nonfinite=False)
        self._cache = cache
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._marked = 0
        self.copies = 0
        self.copied = threading.Condition()

    def model_write(self, block: int, values: torch.Tensor) -> None:
        """The model's stream writes one block (visible to copies only after a wait)."""
        self._pending.append((block, values))

    def mark_step(self) -> None:
        self._marked = len(self._pending)

    def begin_step(self) -> None:
        self._apply(len(self._pending))

    def begin_off_thread(self) -> None:
        self._apply(self._marked)

    def _apply(self, upto: int) -> None:
        for block, values in self._pending[:upto]:
            self._cache[block] = values
        del self._pending[:upto]
        self._marked = max(0, self._marked - upto)

    def copy(self, block_ids: Any, chunk: Chunk, slab: Slab) -> None:
        super().copy(block_ids, chunk, slab)
        with self.copied:
            self.copies += 1
            self.copied.notify_all()

    def wait_copies_issued(self, count: int) -> bool:
        """Sleep until ``count`` chunk copies were issued in all (False after ``WAIT_S``)."""
        with self.copied:
            return self.copied.wait_for(lambda: self.copies >= count, WAIT_S)


class _SlabReturnedOnQueue(WriteStats):
    """Counters whose queue-depth report, made inside ``submit``, lets a writer return a slab.

    ``WritePipeline.submit`` reports the queue depth after the job is queued: here the
    stuck disk is released then, and the report returns once the writer thread that got
    the slab back has issued the next copy. Before the fix, that copy ran before the
    job's wait for the model's stream.
    """

    def __init__(self, disk: StuckDisk, extractor: StreamOrderedExtractor) -> None:
        super().__init__(0)
        self.disk, self.extractor = disk, extractor
        self.armed = False

    def queued(self, depth: int) -> None:
        super().queued(depth)
        if self.armed:
            self.armed = False
            self.disk.release.set()
            assert self.extractor.wait_copies_issued(2), "the writer never copied again"


def _job(pipeline: WritePipeline, root: Path, req_id: str, block: int) -> SaveJob:
    path = str(root / f"{req_id}.safetensors")
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return SaveJob(
        req_id=req_id,
        path=path,
        token_ids=torch.arange(BLOCK, dtype=torch.int64),
        block_ids=[block],
        lock=WriterLock.create(path, dir_fd=dir_fd, request_id=req_id),
        dir_fd=dir_fd,
        metadata=sample_metadata(layer_ids=LAYER_IDS, request_id=req_id, num_prompt_tokens=BLOCK),
        chunks=pipeline.extractor.plan(BLOCK),
        nbytes=BLOCK * pipeline.extractor.token_bytes,
    )


@pytest.mark.parametrize("engine_thread", [True, False], ids=["after-forward", "finish-order"])
def test_a_copy_a_writer_issues_waits_for_the_rows_of_its_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_thread: bool
) -> None:
    """A job submitted while a writer returns a slab still reads the model's rows.

    One slab, one writer thread. Job A's chunk holds the slab in a stuck disk write.
    The model writes job B's block (pending on its stream), the step is marked, B is
    submitted; as B is queued the writer gets its slab back and copies B's chunk. B's
    file must hold the model's values, not the fresh block's zeros.
    """
    layout = CacheLayout(1, BLOCK, LAYERS, HIDDEN)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, LAYERS, HIDDEN)
    extractor = StreamOrderedExtractor(cache, layout)
    disk = StuckDisk(monkeypatch)
    stats = _SlabReturnedOnQueue(disk, extractor)
    pipeline = WritePipeline(
        extractor,
        num_threads=1,
        host_budget=extractor.slab_bytes,  # one slab: one chunk in flight
        when_full="wait",
        max_queued_bytes=1 << 30,
        checksum=True,
        check_nonfinite=False,
        fsync=False,
        stats=stats,
        layer_ids=LAYER_IDS,
    )
    try:
        a_rows = torch.randn(BLOCK, LAYERS, HIDDEN, generator=torch.Generator().manual_seed(1))
        extractor.model_write(0, a_rows)
        extractor.mark_step()
        pipeline.submit(_job(pipeline, tmp_path, "a", 0), engine_thread=engine_thread)
        assert disk.entered.wait(WAIT_S), "job a never reached the disk"

        b_rows = torch.randn(BLOCK, LAYERS, HIDDEN, generator=torch.Generator().manual_seed(2))
        extractor.model_write(1, b_rows)  # the step that computes b's last tokens
        extractor.mark_step()
        stats.armed = True
        pipeline.submit(_job(pipeline, tmp_path, "b", 1), engine_thread=engine_thread)

        reader = HiddenStateReader(
            tmp_path, names=["a.safetensors", "b.safetensors"], lock_timeout=WAIT_S
        )
        got = {os.path.basename(s.path): s.hidden_states for s in reader}
        failure = read_status(str(tmp_path / "b.safetensors.lock")).reason
        assert sorted(got) == ["a.safetensors", "b.safetensors"], failure
        assert torch.equal(got["a.safetensors"], a_rows)
        assert torch.equal(got["b.safetensors"], b_rows)
    finally:
        disk.release.set()
        pipeline.close(WAIT_S)
