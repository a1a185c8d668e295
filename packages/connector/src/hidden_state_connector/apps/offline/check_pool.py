"""Finished vLLM requests -> manifest records, checked on verifier threads.

When vLLM returns a request its file may not be final yet: the connector's writer holds
the sample's lock until it has published the file (or given up, saying why in the lock).
``check_output`` waits on that lock and verifies the file; ``Verifier`` runs it on a
thread pool, so that the loop keeps vLLM fed meanwhile, and hands the records back in
whatever order they finish.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hidden_state_connector.apps.offline.manifest import (
    STATUS_FAILED,
    STATUS_OK,
    SampleRecord,
    sample_name,
)
from hidden_state_connector.apps.offline.sample_check import verify_file
from hidden_state_connector.apps.offline.settings import ExtractOptions


@dataclass
class Job:
    """A request in vLLM: sample ``index``, the file it must write, its prompt and mask."""

    index: int
    path: str
    prompt: list[int]
    loss_mask: list[int] | None = None


def _wrong_path(job: Job, got: Any) -> str | None:
    """Why the connector's answer does not name ``job``'s file, or None if it does."""
    if not got:
        return "vLLM returned no hidden_states_path (is the HiddenStateConnector active?)"
    if os.path.realpath(str(got)) != os.path.realpath(job.path):
        return f"the connector wrote {got}, not {job.path}"
    return None


def check_output(job: Job, output: Any, options: ExtractOptions) -> SampleRecord:
    """Wait until ``job``'s file is final (its lock released), then check it.

    Args:
        job: The request.
        output: vLLM's ``RequestOutput`` for it.
        options: The run's options (layers, output tokens, lock timeout).

    Returns:
        An ok record, or a failed one saying why (the writer's reason when it wrote none).

    Raises:
        ValueError, OSError, hidden_state_reader.SampleError: The file does not check out.
    """
    from hidden_state_reader.files.locks import SharedLock, read_status
    from hidden_state_reader.format import lock_path

    params = dict(getattr(output, "kv_transfer_params", None) or {})
    refused = _wrong_path(job, params.get("hidden_states_path"))
    if refused is not None:
        return SampleRecord(job.index, STATUS_FAILED, error=refused)
    lock = SharedLock.acquire(job.path, timeout=options.lock_timeout)
    if lock is None:
        return SampleRecord(
            job.index,
            STATUS_FAILED,
            error=f"the writer still held the lock after {options.lock_timeout:.0f}s",
        )
    try:
        if not os.path.exists(job.path):
            status = read_status(lock_path(job.path))
            reason = (
                status.reason
                or params.get("hidden_states_error")
                or "no file was written (the writer gave no reason)"
            )
            return SampleRecord(job.index, STATUS_FAILED, error=str(reason))
        expected = list(job.prompt)
        if options.include_output_tokens:
            generated = list(output.outputs[0].token_ids) if output.outputs else []
            expected += generated[:-1]  # the last token was never fed back
        tokens, nbytes = verify_file(
            job.path,
            job.prompt,
            layer_ids=options.captured_layers,
            include_output=options.include_output_tokens,
            expected=expected,
            loss_mask=job.loss_mask,
        )
    finally:
        lock.release()
    return SampleRecord(
        job.index, STATUS_OK, sample_name(job.index), tokens, len(job.prompt), nbytes
    )


class Verifier:
    """Runs ``check_output`` for finished requests on ``options.verify_threads`` threads.

    Args:
        options: The run's options.
    """

    def __init__(self, options: ExtractOptions) -> None:
        from hidden_state_reader.files.flockwait import install_wake_handler

        # The checks wait on locks from pool threads only: arm the kernel wake-up from
        # here (the main thread) so their deadlines interrupt flock instead of polling.
        install_wake_handler()
        self.options = options
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, options.verify_threads), thread_name_prefix="hs-extract-verify"
        )
        self._pending: collections.deque[tuple[Job, concurrent.futures.Future[SampleRecord]]] = (
            collections.deque()
        )

    @property
    def pending(self) -> int:
        """Verifications submitted and not yet collected."""
        return len(self._pending)

    def submit(self, job: Job, output: Any) -> None:
        """Start checking the file of a finished request."""
        self._pending.append((job, self._executor.submit(self._finalize, job, output)))

    def _finalize(self, job: Job, output: Any) -> SampleRecord:
        """In a verifier thread: wait until the file is final, then check it."""
        try:
            return check_output(job, output, self.options)
        except Exception as exc:
            return SampleRecord(job.index, STATUS_FAILED, error=f"verification failed: {exc}")

    def collect(self, record: Callable[[SampleRecord], None]) -> None:
        """Pass the outcome of each finished verification to ``record``, as they finished."""
        waiting: collections.deque[tuple[Job, concurrent.futures.Future[SampleRecord]]] = (
            collections.deque()
        )
        for job, future in self._pending:
            if not future.done():
                waiting.append((job, future))
            elif not future.cancelled():  # cancelled (interrupted): the next run redoes it
                record(future.result())
        self._pending = waiting

    def wait(self, timeout: float) -> None:
        """Block until a verification finishes (or ``timeout`` seconds pass)."""
        concurrent.futures.wait(
            [f for _, f in self._pending],
            timeout=timeout,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def shutdown(self) -> None:
        """Finish the running verifications and cancel the queued ones."""
        self._executor.shutdown(wait=True, cancel_futures=True)
