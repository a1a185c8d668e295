"""The write pipeline: save jobs, the chunk pump, writer threads, back-pressure, shutdown.

Flow of one sample:

1. ``submit``: a ``SaveJob`` (the request's blocks, token ids, lock) joins a FIFO.
2. Its chunks are copied into free host slabs right away, strictly in submission order
   (all of a job's chunks before any of the next job's), as long as slabs are free: on
   submission (the engine's thread, right after the forward pass), and whenever a writer
   thread returns a slab, so no further engine step is needed. Copies from a writer
   thread are safe: the job's KV blocks stay held until ``finished`` reports it; on CUDA
   they run on the connector's stream, which waited for the model's stream at submission.
3. A writer thread takes the job (``JobState.WRITING``, in the same order), creates the
   temp file, writes the header and token ids, then the chunks as they arrive. Strict
   order keeps this deadlock-free with a bounded pool: every job ahead of the one being
   copied holds all the slabs it will ever need, so the writers finish them.
4. The writer thread writes each chunk and returns its slab; at the end it publishes
   the file atomically and releases the lock.
5. ``finished`` reports a job once all its device-to-host copies are complete: its KV
   blocks may be freed then, before the disk write ends (clients wait on the lock).

Any failure (full disk, permissions, vanished directory) fails that one sample: no final
file, the lock released with a ``failed`` status, counters and a log line naming the
request. The server keeps serving.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.buffers import Slab, SlabPool
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import JobState, SaveJob
from hidden_state_connector.engine.write.row_guard import ZeroRowCheck
from hidden_state_connector.engine.write.sample_file import (
    PRODUCTION_HOOKS,
    FileOptions,
    WriteHooks,
)
from hidden_state_connector.engine.write.trace import StageTrace
from hidden_state_reader.files.flockwait import threads_ignore_signals

PREEMPTED = "request preempted while its hidden states were being copied"


def _fail_unstarted(job: SaveJob, stats: WriteStats, reason: str, *, dropped: bool = False) -> None:
    """Fail a job no writer thread will take (it is still reported finished)."""
    job.fail_unwritten(reason)
    job.end_chunks()
    stats.failure(job.req_id, job.path, reason, dropped=dropped)
    job.finished.set()


def _file_options(
    extractor: Extractor,
    layer_ids: Sequence[int] | None,
    checksum: bool,
    check_nonfinite: bool,
    fsync: bool,
) -> FileOptions:
    """How every file is written, with the all-zero row guard over the captured layers."""
    layout = extractor.layout
    zero_rows = ZeroRowCheck(
        layer_ids or range(1, layout.num_layers + 1),
        extractor.stored_itemsize,
        layout.hidden_size,
    )
    return FileOptions(checksum, check_nonfinite, fsync, zero_rows)


def _start_writer_threads(run: Callable[[], None], count: int) -> list[threading.Thread]:
    """Start ``count`` daemon threads running ``run``, with SIGTERM/SIGINT left to the caller.

    vLLM's worker shuts down from its SIGTERM/SIGINT handler: those stay with the
    engine's thread.
    """
    threads = [
        threading.Thread(target=run, name=f"hidden-state-writer-{i}", daemon=True)
        for i in range(count)
    ]
    with threads_ignore_signals():
        for t in threads:
            t.start()
    return threads


class WritePipeline:
    """Owns the slab pool, the writer threads and every job in flight.

    Args:
        extractor: Gathers chunks from the cache.
        num_threads: Writer threads.
        host_budget: Bytes of host slabs.
        when_full: ``"wait"`` or ``"drop"`` (see ``ConnectorConfig``).
        max_queued_bytes: Queue bound for ``"drop"``.
        checksum: Record CRC32s.
        check_nonfinite: Record NaN/inf flags.
        fsync: fsync each file before publishing.
        stats: Where counters go.
        layer_ids: Captured layer ids, in layer-axis order, for the all-zero row guard
            (``row_guard``; None: ids 1..n, every layer checked).
        hooks: What writes each sample and creates each file's writer (``WriteHooks``:
            the production ones unless a benchmark or profiler injects its own).
    """

    def __init__(
        self,
        extractor: Extractor,
        *,
        num_threads: int,
        host_budget: int,
        when_full: str,
        max_queued_bytes: int,
        checksum: bool,
        check_nonfinite: bool,
        fsync: bool,
        stats: WriteStats,
        layer_ids: Sequence[int] | None = None,
        hooks: WriteHooks = PRODUCTION_HOOKS,
    ) -> None:
        self.extractor = extractor
        self.hooks = hooks
        self.pool = SlabPool(extractor.slab_bytes, host_budget, pinned=extractor.on_cuda)
        self.pool.preallocate()
        self.when_full = when_full
        self.max_queued_bytes = max_queued_bytes
        options = _file_options(extractor, layer_ids, checksum, check_nonfinite, fsync)
        self.file_options = replace(options, writer_factory=hooks.writer_factory)
        self.stats = stats
        self.trace = StageTrace()
        self._jobs: deque[SaveJob] = deque()  # submitted, not yet fully produced
        self._unreported: dict[str, SaveJob] = {}
        self._queue: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        # Guards the job list, admissions and chunk production, which the engine's
        # thread and the writer threads both drive.
        self._cond = threading.Condition(threading.RLock())
        self._queued_bytes = 0
        self._closed = False
        self._threads = _start_writer_threads(self._run, num_threads)

    # -- engine-thread side ----------------------------------------------------------

    def submit(self, job: SaveJob, *, engine_thread: bool = True) -> None:
        """Queue a job (or fail it at once when ``when_full="drop"`` and the queue is full).

        Args:
            job: The sample.
            engine_thread: Called from the engine's thread after the step that computed
                the job's last token (on CUDA the connector's stream is ordered after
                the model's stream here); False from other threads, which order after
                the last step the engine marked (``Extractor.mark_step``).
        """
        self.trace.mark(job.stages, "submitted")
        with self._cond:
            self._unreported[job.req_id] = job
            full = (
                self.when_full == "drop" and self._queued_bytes + job.nbytes > self.max_queued_bytes
            )
            closed = self._closed
            if not full and not closed:
                # Order the copy stream after the job's data BEFORE the job becomes
                # visible: a writer thread returning a slab produces the chunks of any
                # job in the list, and a chunk copied before this wait can read rows the
                # model has not written yet (docs/connector.md, "Copies wait for the
                # rows they read").
                if engine_thread:
                    self.extractor.begin_step()
                else:
                    self.extractor.begin_off_thread()
                self._queued_bytes += job.nbytes
                self._jobs.append(job)
                # Writers take jobs in the list's order (the pool's deadlock freedom
                # rests on it), also when two threads submit at once.
                self._queue.put(job)
                self._produce_ready()
        if closed or full:
            reason = "connector is shutting down" if closed else "writer queue full (dropped)"
            _fail_unstarted(job, self.stats, reason, dropped=full)
            return
        self.stats.queued(len(self._unreported))

    def submit_failed(self, job: SaveJob, reason: str) -> None:
        """Register a job that fails before any work (it is still reported finished)."""
        with self._cond:
            self._unreported[job.req_id] = job
        _fail_unstarted(job, self.stats, reason)

    def pump(self) -> None:
        """Copy what slabs allow now (every job was ordered after its data at submission).

        Writer threads do this as they return slabs; the engine's thread and shutdown
        call it too, for good measure (it never blocks).
        """
        with self._cond:
            self._produce_ready()

    def _produce_ready(self) -> None:
        """Copy as many pending chunks into free slabs as possible (never blocks).

        Call with ``self._cond`` held.
        """
        while self._jobs:
            job = self._jobs[0]
            if not issue_copies(job, self.pool, self.extractor, self.trace):
                return  # out of slabs
            self._jobs.popleft()

    def flush(self, req_ids: set[str] | None, timeout: float, reason: str = PREEMPTED) -> None:
        """Finish issuing the copies of these jobs (None: all) before their blocks go.

        For requests preempted after their save was ordered (vLLM frees their blocks,
        the next forward pass may overwrite them), and before sleep releases the cache.
        Blocks the engine's thread until every chunk of those jobs (and of the jobs ahead
        of them) is copied, as writers return slabs, or ``timeout`` passes (then they fail
        with ``reason``: nothing stale is published); on CUDA the model's stream then
        waits for the copies.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            targets = [j for j in self._jobs if req_ids is None or j.req_id in req_ids]
            if not targets:
                return
            self.extractor.begin_step()
            while not all(j.produced_all for j in targets):
                self._produce_ready()
                left = deadline - time.monotonic()
                if all(j.produced_all for j in targets) or left <= 0:
                    break
                self._cond.wait(min(left, 1.0))  # woken by a returned slab
            for job in targets:
                if not job.produced_all:
                    job.fail(reason)
                    # Fails fast: only ends the job's chunk stream.
                    issue_copies(job, self.pool, self.extractor, self.trace)
                    self._jobs.remove(job)
            self.extractor.order_before_compute()

    def finished(self) -> list[str]:
        """Request ids whose device-to-host copies are all complete (each reported once)."""
        done = []
        with self._cond:
            for req_id, job in list(self._unreported.items()):
                if not job.produced_all:
                    continue
                if job.done_event is not None and not job.done_event.query():
                    continue
                del self._unreported[req_id]
                done.append(req_id)
        return done

    def wait_copied(self, req_id: str, timeout: float) -> bool:
        """Sleep until ``req_id``'s copies are issued (True; also if unknown) or ``timeout``."""
        with self._cond:
            job = self._unreported.get(req_id)
            if job is None:
                return True
            return self._cond.wait_for(lambda: job.produced_all, timeout)

    @property
    def in_flight(self) -> int:
        """Samples whose blocks are still held (not yet reported finished)."""
        with self._cond:
            return len(self._unreported)

    # -- writer threads ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._cond:
                job.state = JobState.WRITING
            try:
                self._write(job)
            finally:
                job.close_dir()
                with self._cond:
                    self._queued_bytes -= job.nbytes
                job.finished.set()

    def _return_slab(self, slab: Slab) -> None:
        """Give a slab back and let the next chunks use it (from a writer thread)."""
        self.pool.release(slab)
        with self._cond:
            self._produce_ready()
            self._cond.notify_all()

    def _write(self, job: SaveJob) -> None:
        started = time.monotonic()
        copies_done = partial(self.trace.mark, job.stages, "copies_done")
        write = self.hooks.write_sample
        failure = write(job, self.extractor, self.file_options, self._return_slab, copies_done)
        if failure is None:
            job.state = JobState.PUBLISHED
            self.stats.written(job.nbytes, time.monotonic() - started)
            self._traced(job, "published")
        else:
            job.state = JobState.FAILED
            self.stats.failure(job.req_id, job.path, failure)
            self._traced(job, "failed")

    def _traced(self, job: SaveJob, outcome: str) -> None:
        self.trace.mark(job.stages, "released")
        self.trace.record(job.req_id, job.path, outcome, job.stages)

    # -- shutdown ------------------------------------------------------------------

    def close(self, timeout: float) -> int:
        """Drain queued writes for up to ``timeout`` seconds, fail the rest; return how many."""
        with self._cond:
            self._closed = True
            jobs = list(self._jobs) + [j for j in self._unreported.values() if j not in self._jobs]
        self.pump()
        deadline = time.monotonic() + timeout
        for job in jobs:  # writer threads produce and write without engine steps
            job.finished.wait(max(0.0, deadline - time.monotonic()))
        abandoned = 0
        with self._cond:
            for job in jobs:
                if not job.finished.is_set():
                    abandoned += 1
                    job.fail("connector shut down before the sample was written")
                    job.end_chunks()
        for _ in self._threads:
            self._queue.put(None)
        end = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        for job in jobs:
            if job.state is JobState.QUEUED:  # no writer thread took it: release it here
                job.fail_unwritten("connector shut down before the sample was written")
        return abandoned


def issue_copies(job: SaveJob, pool: SlabPool, extractor: Extractor, trace: StageTrace) -> bool:
    """Issue the job's remaining chunk copies; False if slabs ran out first.

    Once every chunk is issued, or the job failed, the job's chunk stream is ended and
    ``done_event`` completes with its last copy. Call with the pipeline's lock held.
    """
    while job.next_chunk < len(job.chunks) and job.failure is None:
        slab = pool.try_acquire()
        if slab is None:
            return False
        chunk = job.chunks[job.next_chunk]
        try:
            extractor.copy(job.block_ids, chunk, slab)
        except Exception as exc:  # e.g. a CUDA error: fail the sample, not the server
            pool.release(slab)
            job.fail(f"gather failed: {exc!r}")
            break
        job.next_chunk += 1
        job.ready.put((chunk, slab))
    job.done_event = extractor.record_done()
    trace.mark(job.stages, "copies_issued")
    job.end_chunks()
    return True
