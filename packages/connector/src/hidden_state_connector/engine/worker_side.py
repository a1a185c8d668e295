"""Worker-side half of the connector: locks, gathering and writing (TP rank 0 only).

Runs in each worker process. Only tensor-parallel rank 0 writes: the hidden states are
replicated across TP ranks, and ``get_finished_count() == 1`` tells vLLM to wait for
one report per request, so the other ranks never hold blocks.

Per engine step (vLLM calls these in this order):

- ``before_forward`` (``handle_preemptions``): requests preempted after their save was
  ordered get their copies finished before the forward pass may reuse their blocks.
- ``get_finished``: create new locks, start saves ordered for hidden states computed
  in earlier steps, report copied samples so vLLM frees their blocks.
- ``after_forward`` (``wait_for_save``, after the drafter stored this step's hidden
  states): create new locks, start saves of prompts this step completed.

Orders can also arrive between steps from the scheduler half in the same process
(``accept``, see ``handoff.same_process``).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import torch

from hidden_state_connector import __version__
from hidden_state_connector.engine import compat
from hidden_state_connector.engine.capture import describe_capture
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.handoff import same_process
from hidden_state_connector.engine.handoff.socket_channel import OrderListener
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.sleep_guard import RELEASE_REASON, SleepGuard
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_connector.engine.write.sample_file import PRODUCTION_HOOKS, WriteHooks
from hidden_state_connector.engine.write.store_backend import StoreBackend
from hidden_state_connector.engine.write.target import SampleTarget, pin_sample
from hidden_state_connector.logs import get_logger
from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.format import speculation_metadata, tag_metadata

log = get_logger(__name__)
SHUT_DOWN = "HiddenStateConnector shut down: %d files, %.2f GB, %d failed, %d abandoned"


class WorkerSide:
    """State the worker-side connector keeps.

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        block_size: Block size of the hidden-state cache group.
        layer_ids: Captured layer ids, in layer-axis order.
        stats: Shared counters.
        hooks: Handed to the ``WritePipeline`` (``HiddenStateConnector.write_hooks``).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        vllm_config: Any,
        block_size: int,
        layer_ids: list[int],
        stats: WriteStats,
        hooks: WriteHooks = PRODUCTION_HOOKS,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.root = os.path.abspath(config.shared_storage_path)
        self.block_size = block_size
        self.layer_ids = layer_ids
        self.stats = stats
        self.vllm_config = vllm_config
        # Raises ValueError for layer ids the model does not have: vLLM does not start.
        self.capture = describe_capture(
            vllm_config,
            layer_ids,
            connector_version=__version__,
            vllm_version=compat.vllm_version(),
        )
        self.is_writer = True
        self.pipeline: WritePipeline | None = None
        self.store: StoreBackend | None = None  # storage_backend="mooncake"
        self._targets: dict[str, SampleTarget] = {}
        self._target_errors: dict[str, str] = {}
        # The step metadata whose locks exist: get_finished and wait_for_save both see
        # it, and a save started in between must not get a second lock.
        self._locked_meta: HiddenStateConnectorMetadata | None = None
        # Samples whose blocks vLLM holds for us, until reported: ``_unreported`` from
        # submission; ``_announced`` once vLLM has said the request finished (only then
        # may it be reported); ``_copied`` once its device-to-host copies are done.
        self._unreported: set[str] = set()
        self._announced: set[str] = set()
        self._copied: set[str] = set()
        # The engine's thread and same-process hand-offs both enter here.
        self._mutex = threading.RLock()
        self._engine_key = compat.engine_key(vllm_config)
        self._listener: OrderListener | None = None
        self._closed = False
        self.sleep = SleepGuard(config.shutdown_timeout, self._mutex)

    # -- set-up ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the hidden-state cache, work out its layout, start the writers."""
        self.is_writer = compat.tensor_parallel_rank() == 0
        layer_name = compat.find_cache_only_layer(self.vllm_config, kv_caches)
        kv_cache = kv_caches[layer_name]
        layout = compat.probe_layout(kv_cache, self.block_size, len(self.layer_ids))
        token_bytes = layout.num_layers * layout.hidden_size * kv_cache.dtype.itemsize
        block_bytes = layout.block_size * token_bytes
        blocks_per_chunk = max(1, self.config.chunk_bytes // block_bytes)
        extractor = Extractor(
            kv_cache,
            layout,
            blocks_per_chunk,
            check_nonfinite=self.config.check_nonfinite,
            storage=self.config.storage_dtype,
        )
        log.info(
            "HiddenStateConnector: %s, layers %s of %s, hidden %d, %s; cache %s (token axis "
            "%d), %d blocks (%d tokens) per chunk; writing to %s%s",
            kv_cache.device,
            self.layer_ids,
            self.capture.num_hidden_layers or "?",
            layout.hidden_size,
            f"{kv_cache.dtype} stored as {extractor.storage}",
            tuple(kv_cache.shape),
            layout.token_axis,
            blocks_per_chunk,
            blocks_per_chunk * layout.block_size,
            self.root,
            "" if self.is_writer else " (not this TP rank)",
        )
        if self.is_writer:
            self._start_writers(extractor)

    def _start_writers(self, extractor: Extractor) -> None:
        """Start the write pipeline (rank 0) over ``extractor``'s source of rows."""
        if self.config.storage_backend == "mooncake":
            self.store = StoreBackend(self.config, self.root)  # raises: start-up fails
        else:
            os.makedirs(self.root, exist_ok=True)
        self.pipeline = WritePipeline(
            extractor,
            num_threads=self.config.num_writer_threads,
            host_budget=self.config.host_buffer_bytes,
            when_full=self.config.when_full,
            max_queued_bytes=self.config.max_queued_bytes,
            # Store samples always carry a CRC32: readers check every one.
            checksum=self.config.checksum or self.store is not None,
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
        """Finish the copies of preempted requests' samples before their blocks are reused."""
        if not self.is_writer or self.pipeline is None or not meta.preempted:
            return
        with self._mutex:
            self.pipeline.flush(set(meta.preempted), self.config.shutdown_timeout)

    def after_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Create new locks; start the saves whose last tokens this step computed."""
        if not self.is_writer or self.pipeline is None:
            return
        with self._mutex:
            self.pipeline.extractor.mark_step()
            self.create_locks(meta)
            for order in meta.saves:
                if order.written_this_step:
                    self._start(order)

    def accept(self, order: SaveOrder) -> None:
        """Start a save handed over between steps (``handoff``: same process or socket)."""
        with self._mutex:
            if self.pipeline is not None:
                self._start(order, engine_thread=False)  # after shutdown: failed, with why

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
        if self.store is not None:
            return self.store.target(req_id, path)
        return pin_sample(self.root, req_id, path, lock=self.config.use_synchronization_lock)

    def get_finished(
        self, meta: HiddenStateConnectorMetadata | None, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """Start saves of earlier steps' states; report requests whose blocks may be freed."""
        if not self.is_writer or self.pipeline is None:
            return None, None
        with self._mutex:
            if meta is not None:
                self.create_locks(meta)
                for order in meta.saves:
                    if not order.written_this_step:
                        self._start(order)
            self.pipeline.pump()
            # vLLM only accepts ids it has announced as finished (this call or before);
            # ids of requests we hold nothing for (never scheduled) must not pile up.
            # (An order sent over the channel may land after the announcement.)
            self._announced |= {
                r
                for r in finished_req_ids
                if r in self._unreported or r in self._targets or r in self._target_errors
            }
            self._copied.update(self.pipeline.finished())
            done = self._copied & self._announced
            self._copied -= done
            self._announced -= done
            self._unreported -= done
            self.stats.maybe_log(len(self._unreported))
        return (done or None), None

    def _start(self, order: SaveOrder, *, engine_thread: bool = True) -> None:
        assert self.pipeline is not None
        target = self._targets.pop(order.req_id, None)
        failure = order.failure or self._target_errors.pop(order.req_id, None)
        if failure is None and self.sleep.released:  # its states went with the cache
            failure = RELEASE_REASON
        if failure is None and target is None:
            try:  # not pinned at schedule time (should not happen): do it now
                target = self._pin(order.req_id, order.path)
            except (OSError, PathOutsideRootError) as exc:
                failure = f"cannot create lock: {exc}"
        token_ids = torch.tensor(order.token_ids, dtype=torch.int64)
        extractor = self.pipeline.extractor
        job = SaveJob(
            req_id=order.req_id,
            path=self.store.staged_path(order.path) if self.store else order.path,
            token_ids=token_ids,
            block_ids=order.block_ids,
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
        """Drain queued writes (bounded), then release every lock (idempotent)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)  # the hook would keep this worker's buffers alive
        same_process.unregister(self._engine_key, self.accept)
        if self._listener is not None:
            self._listener.close()  # hands over the orders already sent first
        abandoned = 0
        if self.pipeline is not None:
            abandoned = self.pipeline.close(self.config.shutdown_timeout)
        for target in self._targets.values():
            target.abandon("engine shut down before the request finished")
        self._targets.clear()
        if self.store is not None:
            self.store.close()
        total = self.stats.total
        log.info(SHUT_DOWN, total.files, total.bytes / 1e9, total.failures, abandoned)


def _mask_tensor(mask: list[int] | None) -> torch.Tensor | None:
    """A save order's 0/1 list as uint8 (bytearray packs it in C: 20x torch.tensor's speed)."""
    if mask is None:
        return None
    if not mask:
        return torch.zeros(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
    return torch.frombuffer(bytearray(mask), dtype=torch.uint8)
