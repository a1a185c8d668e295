"""One sample on its way from the KV cache to disk (``SaveJob``), and its lock helper.

A job has two sides that advance independently, because a writer thread takes a job
while its chunks are still being copied out:

- the write side, one ``JobState``: ``QUEUED`` -> ``WRITING`` -> ``PUBLISHED`` or
  ``FAILED`` (``FAILED`` straight from ``QUEUED`` for a job refused or abandoned
  before any writer took it);
- the copy side: chunks issued in order (``next_chunk``) until the chunk stream is
  ended (``produced_all``), after the last chunk or at the first failure.
"""

from __future__ import annotations

import enum
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hidden_state_connector.engine.write.buffers import Slab
from hidden_state_connector.engine.write.gather import Chunk
from hidden_state_reader.files.locks import WriterLock

END_OF_CHUNKS = None
"""Sentinel in a job's chunk queue: no more chunks will come."""


class JobState(enum.Enum):
    """Where a job's file stands (the write side; see the module docstring)."""

    QUEUED = "queued"
    """Submitted; no writer thread owns its file and lock yet."""
    WRITING = "writing"
    """A writer thread owns it: it creates, fills and publishes the file."""
    PUBLISHED = "published"
    """The final file exists and the lock was released."""
    FAILED = "failed"
    """No final file; the lock was released with the reason (``SaveJob.failure``)."""


@dataclass(eq=False)
class SaveJob:
    """One sample on its way from the KV cache to disk.

    Attributes:
        req_id: vLLM request id.
        path: Final data path.
        token_ids: The tokens whose hidden states are saved.
        block_ids: The request's blocks in the hidden-state cache group.
        lock: The sample's writer lock (None when locks are disabled).
        dir_fd: Pinned descriptor of the sample's directory (None: use ``path``).
        metadata: Header metadata of the file.
        chunks: The gather plan.
        nbytes: Bytes of hidden states (what the queue bound counts).
        loss_mask: ``[tokens]`` uint8 0/1 to store with the sample (None: no mask).
        state: Where the file stands.
        failure: Why the sample fails (the first reason given), None while it may succeed.
        next_chunk: Index of the next chunk to copy out.
        produced_all: The chunk stream is ended (every copy issued, or given up).
        done_event: Completes when every copy of the job has (CUDA; None on CPU).
        stages: ``StageTrace`` times.
        finished: Set once nothing of the job is in flight any more.
        ready: Copied chunks, in order, then ``END_OF_CHUNKS``.
    """

    req_id: str
    path: str
    token_ids: torch.Tensor
    block_ids: list[int]
    lock: WriterLock | None
    dir_fd: int | None
    metadata: dict[str, str]
    chunks: list[Chunk]
    nbytes: int
    loss_mask: torch.Tensor | None = None
    state: JobState = JobState.QUEUED
    failure: str | None = None
    next_chunk: int = 0
    produced_all: bool = False
    done_event: Any = None
    stages: dict[str, float] = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    ready: queue.SimpleQueue[tuple[Chunk, Slab] | None] = field(default_factory=queue.SimpleQueue)

    @property
    def published(self) -> bool:
        """Whether the final file was published."""
        return self.state is JobState.PUBLISHED

    def fail(self, reason: str) -> None:
        """Stop producing chunks for this job (the first reason wins)."""
        if self.failure is None:
            self.failure = reason

    def end_chunks(self) -> None:
        """End the chunk stream, so the writer stops waiting for chunks (idempotent)."""
        if not self.produced_all:
            self.produced_all = True
            self.ready.put(END_OF_CHUNKS)

    def fail_unwritten(self, reason: str) -> None:
        """Fail a job no writer thread took: release its lock and directory now."""
        self.fail(reason)
        self.state = JobState.FAILED
        if self.lock is not None:
            self.lock.fail(reason)
        self.close_dir()

    def close_dir(self) -> None:
        """Close the pinned directory descriptor (idempotent)."""
        fd, self.dir_fd = self.dir_fd, None
        if fd is not None:
            os.close(fd)
