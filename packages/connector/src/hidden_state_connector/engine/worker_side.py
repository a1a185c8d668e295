"""Worker-side half of the connector: locks, save orders, block reports (TP rank 0 only).

Runs in each worker process. Only tensor-parallel rank 0 writes: the hidden states are
replicated across TP ranks, and ``get_finished_count() == 1`` tells vLLM to wait for
one report per request, so the other ranks never hold blocks. What differs between
capture engines is the ``RowSource`` (``engine.seam``): where a save's rows live and the
per-step hooks; what differs between media is the ``Sink``. Per step (vLLM's order):

- ``before_forward`` (``handle_preemptions``) and ``bind_forward`` (``start_load_kv``):
  the row source's, before the forward pass.
- ``get_finished``: create new locks, queue saves ordered for hidden states computed
  in earlier steps, report copied samples so vLLM frees their blocks.
- ``after_forward`` (``wait_for_save``): create new locks; the row source takes the
  step's rows and starts the saves this step completed.

Orders can also arrive between steps from the scheduler half in the same process
(``accept``, see ``handoff.same_process``).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hidden_state_connector import __version__
from hidden_state_connector.engine import compat
from hidden_state_connector.engine.capture import describe_capture
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.handoff import same_process
from hidden_state_connector.engine.handoff.socket_channel import OrderListener
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.seam import RowSource, Sink
from hidden_state_connector.engine.sleep_guard import RELEASE_REASON, SleepGuard
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_connector.engine.write.sample_file import PRODUCTION_HOOKS, WriteHooks
from hidden_state_connector.engine.write.target import SampleTarget
from hidden_state_connector.logs import get_logger
from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.format import speculation_metadata, tag_metadata

log = get_logger(__name__)
SHUT_DOWN = "HiddenStateConnector shut down: %d files, %.2f GB, %d failed, %d abandoned"


class WorkerSide:
    """State the worker-side connector keeps (built by ``engine.engines.worker_side``).

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        layer_ids: Captured layer ids, in layer-axis order.
        stats: Shared counters.
        rows: The capture engine's worker half.
        open_sink: Joins the storage medium (rank 0, at ``register``; raises: start-up
            fails).
        hooks: Handed to the ``WritePipeline`` (``HiddenStateConnector.write_hooks``).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        vllm_config: Any,
        layer_ids: list[int],
        stats: WriteStats,
        *,
        rows: RowSource,
        open_sink: Callable[[], Sink],
        hooks: WriteHooks = PRODUCTION_HOOKS,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.root = os.path.abspath(config.shared_storage_path)
        self.layer_ids = layer_ids
        self.stats = stats
        self.vllm_config = vllm_config
        self.rows = rows
        self._open_sink = open_sink
        # Raises ValueError for layer ids the model does not have: vLLM does not start.
        self.capture = describe_capture(
            vllm_config,
            layer_ids,
            connector_version=__version__,
            vllm_version=compat.vllm_version(),
        )
        self.is_writer = True
        self.pipeline: WritePipeline | None = None
        self.sink: Sink | None = None
        self._targets: dict[str, SampleTarget] = {}
        self._target_errors: dict[str, str] = {}
        # The step metadata whose locks exist: get_finished and wait_for_save both see
        # it, and a save started in between must not get a second lock.
        self._locked_meta: HiddenStateConnectorMetadata | None = None
        # Samples whose rows are held for us, until reported: ``_unreported`` from
        # submission; ``_announced`` once vLLM has said the request finished (only then
        # may it be reported); ``_copied`` once its copies to the host are done.
        self._unreported: set[str] = set()
        self._announced: set[str] = set()
        self._copied: set[str] = set()
        # The engine's thread, the row source's thread and hand-offs all enter here.
        self._mutex = threading.RLock()
        self._engine_key = compat.engine_key(vllm_config)
        self._listener: OrderListener | None = None
        self._closed = False
        self.sleep = SleepGuard(config.shutdown_timeout, self._mutex)

    @property
    def mutex(self) -> threading.RLock:
        """The lock the engine's thread, the row source and hand-offs share."""
        return self._mutex

    # -- set-up ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the rows' source (the row source's), start the writers (rank 0)."""
        writes = compat.tensor_parallel_rank() == 0
        extractor = self.rows.register(kv_caches, writes, self)
        self.is_writer = writes and extractor is not None
        if extractor is not None:
            self._start_writers(extractor)

    def _start_writers(self, extractor: Extractor) -> None:
        """Join the medium and start the write pipeline over ``extractor``'s rows."""
        self.sink = self._open_sink()
        self.pipeline = WritePipeline(
            extractor,
            num_threads=self.config.num_writer_threads,
            host_budget=self.config.host_buffer_bytes,
            when_full=self.config.when_full,
            max_queued_bytes=self.config.max_queued_bytes,
            checksum=self.config.checksum or self.sink.always_checksum,
            check_nonfinite=self.config.check_nonfinite,
            fsync=self.config.fsync,
            stats=self.stats,
            layer_ids=self.layer_ids,
            hooks=self.hooks,
        )
        same_process.register(self._engine_key, self.accept, self.stats.recent_failure)
        try:
            self._listener = OrderListener(self._engine_key, self.accept)
        except OSError as exc:  # finish-time orders then travel in the step metadata
            log.warning("HiddenStateConnector: no order channel (%s)", exc)
        # vLLM calls shutdown(); this covers interpreters that exit without it.
        atexit.register(self.shutdown)

    # -- per step -------------------------------------------------------------------

    def before_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Before the forward pass (``handle_preemptions``): the row source's hook."""
        self.rows.before_forward(meta)

    def bind_forward(self, forward_context: Any, attn_metadata: Any = None) -> None:
        """The step's forward context (``start_load_kv``): the row source's hook."""
        self.rows.bind_forward(forward_context, attn_metadata)

    def after_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Create new locks; the row source takes the step's rows and starts its saves."""
        if self.is_writer and self.pipeline is not None:
            with self._mutex:
                self.create_locks(meta)
        self.rows.after_forward(meta)

    def accept(self, order: SaveOrder) -> None:
        """A save handed over between steps (``handoff``): after the rows in flight."""
        self.rows.queue_saves((order,), engine_thread=False)

    def flush(self, req_ids: set[str]) -> None:
        """Finish the copies of these requests' samples now (bounded)."""
        if self.is_writer and self.pipeline is not None:
            with self._mutex:
                self.pipeline.flush(req_ids, self.config.shutdown_timeout)

    def create_locks(self, meta: HiddenStateConnectorMetadata) -> None:
        """Pin the directory and create the lock of every new request."""
        if not self.is_writer or meta is self._locked_meta:
            return
        self._locked_meta = meta
        for new in meta.new_samples:
            if new.req_id in self._targets or new.req_id in self._target_errors:
                continue
            try:
                self._targets[new.req_id] = self._pin(new.req_id, new.path)
            except (OSError, PathOutsideRootError) as exc:
                self._target_errors[new.req_id] = f"cannot create lock: {exc}"

    def _pin(self, req_id: str, path: str) -> SampleTarget:
        assert self.sink is not None
        return self.sink.target(req_id, path)

    def get_finished(
        self, meta: HiddenStateConnectorMetadata | None, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, list[str]]:
        """Queue earlier steps' saves; requests whose blocks may go, and rows let go of."""
        if not self.is_writer or self.pipeline is None:
            return None, []
        if meta is not None:
            with self._mutex:
                self.create_locks(meta)
            if meta.saves:
                later = [order for order in meta.saves if not order.written_this_step]
                if later:
                    self.rows.queue_saves(later, engine_thread=True)
        with self._mutex:
            self.pipeline.pump()
            # vLLM only accepts ids it has announced as finished (this call or before);
            # ids of requests we hold nothing for (never scheduled) must not pile up.
            # (An order sent over the channel may land after the announcement.)
            self._announced |= {
                r
                for r in finished_req_ids
                if r in self._unreported or r in self._targets or r in self._target_errors
            }
            copied = set(self.pipeline.finished())
            self._copied |= copied
            let_go = list(self.rows.copied(copied))
            done = self._copied & self._announced
            self._copied -= done
            self._announced -= done
            self._unreported -= done
            self.stats.maybe_log(len(self._unreported))
        return (done or None), let_go

    def start_saves(self, orders: Iterable[SaveOrder], *, engine_thread: bool) -> None:
        """Turn save orders into save jobs (after shutdown: failed, with why)."""
        with self._mutex:
            if self.pipeline is not None:
                for order in orders:
                    self._start(order, engine_thread=engine_thread)

    def _start(self, order: SaveOrder, *, engine_thread: bool = True) -> None:
        assert self.pipeline is not None
        block_ids, missing = self.rows.rows_of(order)
        target = self._targets.pop(order.req_id, None)
        failure = order.failure or missing or self._target_errors.pop(order.req_id, None)
        if failure is None and self.sleep.released:  # its states went with the cache
            failure = RELEASE_REASON
        if failure is None and target is None:
            try:  # not pinned at schedule time (should not happen): do it now
                target = self._pin(order.req_id, order.path)
            except (OSError, PathOutsideRootError) as exc:
                failure = f"cannot create lock: {exc}"
        assert self.sink is not None
        extractor = self.pipeline.extractor
        job = SaveJob(
            req_id=order.req_id,
            path=self.sink.staged_path(order.path),
            token_ids=torch.tensor(order.token_ids, dtype=torch.int64),
            block_ids=block_ids,
            lock=target.lock if target is not None else None,
            dir_fd=target.dir_fd if target is not None else None,
            metadata=self.capture.metadata(
                request_id=order.req_id, num_prompt_tokens=order.num_prompt_tokens
            )
            | tag_metadata(order.tags)
            | speculation_metadata(order.num_draft_tokens, order.num_accepted_tokens),
            chunks=extractor.plan(len(order.token_ids)),
            nbytes=len(order.token_ids) * extractor.token_bytes,
            loss_mask=_mask_tensor(order.loss_mask),
        )
        self._unreported.add(order.req_id)
        if failure is not None:
            self.pipeline.submit_failed(job, failure)
        else:
            self.pipeline.submit(job, engine_thread=engine_thread)

    # -- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Rows in flight stored, queued writes drained (bounded), every lock released.

        Idempotent.
        """
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)  # the hook would keep this worker's buffers alive
        same_process.unregister(self._engine_key, self.accept)
        if self._listener is not None:
            self._listener.close()  # hands over the orders already sent first
        self.rows.close(self.config.shutdown_timeout)
        abandoned = 0
        if self.pipeline is not None:
            abandoned = self.pipeline.close(self.config.shutdown_timeout)
        for target in self._targets.values():
            target.abandon("engine shut down before the request finished")
        self._targets.clear()
        if self.sink is not None:
            self.sink.close()
        total = self.stats.total
        log.info(SHUT_DOWN, total.files, total.bytes / 1e9, total.failures, abandoned)


def _mask_tensor(mask: list[int] | None) -> torch.Tensor | None:
    """A save order's 0/1 list as uint8 (bytearray packs it in C: 20x torch.tensor's speed)."""
    if mask is None:
        return None
    if not mask:
        return torch.zeros(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
    return torch.frombuffer(bytearray(mask), dtype=torch.uint8)
