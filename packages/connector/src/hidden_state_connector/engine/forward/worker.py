"""``ForwardWorkerSide``: the worker half of forward capture (TP rank 0 captures and writes).

It is a ``WorkerSide`` whose rows come from the forward pass instead of a hidden-state
KV-cache group: locks, save orders, tags, idempotency, the write pipeline and its
back-pressure are the same. Per step (``after_forward``, vLLM's ``wait_for_save``, still
inside the step's forward context) the engine's thread only starts copying the step's
staging rows to the host (``StepTransfer``); the ingest thread then routes them to their
requests' positions in the host arena and starts the saves, strictly after every earlier
step's rows (``IngestThread``). A save's ``block_ids`` are its arena blocks; they go back
to the arena once its copies are done. Under pipeline parallelism (``stages``) rank 0 of
the last stage is this writer, with every stage's rows; rank 0 of each other stage only
sends its own.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.arena import ARENA_BLOCK_TOKENS, RowArena
from hidden_state_connector.engine.forward.ingest import IngestThread
from hidden_state_connector.engine.forward.install import staging_for
from hidden_state_connector.engine.forward.prefix_rows import HeldPrefixRows
from hidden_state_connector.engine.forward.routing import RowRouter
from hidden_state_connector.engine.forward.stages import Pipeline, join_pipeline
from hidden_state_connector.engine.forward.staging import StepStaging
from hidden_state_connector.engine.forward.transfer import StepCopy, StepTransfer
from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.worker_side import WorkerSide
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.sample_file import PRODUCTION_HOOKS, WriteHooks
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)



class ForwardWorkerSide(WorkerSide):
    """Worker-side state of forward capture.

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        block_size: Block size of the attention group the slot mapping indexes.
        layer_ids: Captured layer ids, ascending.
        stats: Shared counters.
        slot_layer: An attention layer of that group (its slot mapping is read).
        hooks: The write path's seams (``WriteHooks``; benchmarks replace them).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        vllm_config: Any,
        block_size: int,
        layer_ids: list[int],
        stats: WriteStats,
        *,
        slot_layer: str,
        hooks: WriteHooks = PRODUCTION_HOOKS,
    ) -> None:
        super().__init__(config, vllm_config, block_size, layer_ids, stats, hooks)
        self.slot_layer = slot_layer
        self.router = RowRouter(block_size)
        self.staging: StepStaging | None = None
        self.arena: RowArena | None = None
        self.held: HeldPrefixRows | None = None
        self.transfer: StepTransfer | None = None
        self.ingest: IngestThread | None = None
        self._row_failures: dict[str, str] = {}
        self._slot_mappings: Any = None  # this step's, from the forward context
        self.stages: Pipeline | None = None  # pipeline parallel: this stage's part

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the staging hooked into the model at its construction; start the writers."""
        self.is_writer = compat.tensor_parallel_rank() == 0
        if not self.is_writer:  # the states are replicated; rank 0 captures them
            return
        # Under pipeline parallelism every stage joins the channel first: one that fails
        # below then fails vLLM's start-up instead of leaving the others waiting for it.
        self.stages = join_pipeline(
            self.layer_ids,
            self.capture.num_hidden_layers or 0,
            max(600.0, self.config.shutdown_timeout),
        )
        self.staging = staging_for(self.vllm_config)
        if self.staging is None:
            raise RuntimeError(
                "HiddenStateConnector (capture='forward'): the capture was not installed when "
                "vLLM built the model, so nothing would be captured. vLLM installs it through "
                "this package's plugin (entry point vllm.general_plugins: "
                "hidden_state_connector): if VLLM_PLUGINS is set, add hidden_state_connector "
                "to it; otherwise reinstall hidden-state-connector in vLLM's environment."
            )
        if not self.stages.plan.is_last:  # no locks, saves or reports: the last stage's
            self.is_writer = False
            self.stages.start_sending(self.staging.rows)
            return
        model_config = self.vllm_config.model_config
        hidden = int(model_config.get_hidden_size())
        dtype = model_config.dtype
        self.arena = RowArena(
            self.config.capture_buffer_bytes, ARENA_BLOCK_TOKENS, len(self.layer_ids), hidden, dtype
        )
        self.held = HeldPrefixRows(self.arena, int(self.vllm_config.cache_config.block_size))
        layout = CacheLayout(1, ARENA_BLOCK_TOKENS, len(self.layer_ids), hidden)
        block_bytes = ARENA_BLOCK_TOKENS * len(self.layer_ids) * hidden * dtype.itemsize
        extractor = Extractor(
            self.arena.data,
            layout,
            max(1, self.config.chunk_bytes // block_bytes),
            check_nonfinite=self.config.check_nonfinite,
            storage=self.config.storage_dtype,
        )
        log.info(
            "HiddenStateConnector (capture=forward): layers %s, hidden %d, %s; "
            "staging %s on %s; host arena %d blocks of %d tokens; writing to %s",
            self.layer_ids,
            hidden,
            dtype,
            tuple(self.staging.rows.shape),
            self.staging.rows.device,
            self.arena.num_blocks,
            ARENA_BLOCK_TOKENS,
            self.root,
        )
        self.transfer = StepTransfer(self.staging.rows)
        log.info(
            "forward capture: %.1f MiB of host buffers for rows in flight",
            self.transfer.host_bytes / 2**20,
        )
        self.ingest = IngestThread("hidden-state-ingest", self._ingest_failed)
        self._start_writers(extractor)

    def before_forward(self, forward_context: Any, attn_metadata: Any = None) -> None:
        """Keep this step's slot mappings (``start_load_kv``).

        From the forward context (vLLM's V1 runner calls inside it); else from the
        attention metadata that vLLM 0.34's V2 runner passes (reviewed from source only).
        """
        mapping = getattr(forward_context, "slot_mapping", None)
        if not mapping and isinstance(attn_metadata, dict):
            mapping = {
                layer: meta.slot_mapping
                for layer, meta in attn_metadata.items()
                if getattr(meta, "slot_mapping", None) is not None
            }
        self._slot_mappings = mapping or None

    def after_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Start copying this step's rows to the host; the ingest thread does the rest."""
        if self.stages is not None and self.stages.sender is not None:
            mapping = partial(compat.step_slot_mapping, self.slot_layer, self._slot_mappings)
            self.stages.sender.step(bool(meta.steps), meta.batch_tokens, mapping)
            return
        if not self.is_writer or self.pipeline is None or self.ingest is None:
            return
        with self._mutex:
            self.create_locks(meta)
        copy = None
        if meta.steps and self.transfer is not None:
            with torch.inference_mode():
                slots = compat.step_slot_mapping(self.slot_layer, self._slot_mappings)
                copy = self.transfer.submit(meta.batch_tokens or slots.shape[0], slots)
        orders = [order for order in meta.saves if order.written_this_step]
        released = list(meta.released_rows)
        if copy is not None or orders or released:
            steps = list(meta.steps)
            self.ingest.put(lambda: self._ingest(copy, steps, orders, released))

    def accept(self, order: SaveOrder) -> None:
        """A save handed over between steps: started after the rows already in flight."""
        if self.ingest is not None:
            self.ingest.put(lambda: self._ingest(None, [], [order]))
        else:
            super().accept(order)

    def get_finished(
        self, meta: HiddenStateConnectorMetadata | None, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """``WorkerSide.get_finished``, with saves queued behind the rows in flight."""
        if meta is not None and self.ingest is not None and self.is_writer:
            with self._mutex:
                self.create_locks(meta)
            orders = [order for order in meta.saves if not order.written_this_step]
            if orders:
                self.ingest.put(lambda: self._ingest(None, [], orders))
            meta = dataclasses.replace(meta, saves=[], new_samples=[])
        done, received = super().get_finished(meta, finished_req_ids)
        if self.arena is not None:
            with self._mutex:
                for req_id in done or ():
                    self.arena.release(req_id)
                    self.router.forget(req_id)
        return done, received

    def _ingest(
        self,
        copy: StepCopy | None,
        steps: list[Any],
        orders: list[SaveOrder],
        released: list[int] | None = None,
    ) -> None:
        """Ingest thread: this step's rows into the arena, then its saves (always started).

        Held prefix rows the scheduler dropped go last: a request of this step may use them.
        """
        try:
            if copy is not None:
                self._ingest_rows(copy, steps)
        finally:
            with self._mutex:
                for order in orders:
                    self._start(order, engine_thread=False)
                if released and self.held is not None:
                    self.held.release(released)

    def _ingest_rows(self, copy: StepCopy, steps: list[Any]) -> None:
        assert self.transfer is not None and self.stages is not None and self.arena is not None
        try:
            shape = (int(self.arena.data.shape[-1]), self.arena.data.dtype)
            parts = self.stages.parts(copy, bool(steps), shape, partial(self._fail_rows, steps))
            copy.wait()
            with self._mutex, torch.inference_mode():
                self.router.update(steps)
                for columns, slots, rows in parts:
                    self._take_rows(slots, rows, steps, columns)
        except Exception as exc:  # their samples fail with the reason; the engine runs on
            self._fail_rows(steps, f"rows not stored: {exc!r}")
            raise
        finally:
            self.transfer.done(copy)

    def _fail_rows(self, steps: list[Any], reason: str) -> None:
        with self._mutex:
            for step in steps:
                self._row_failures.setdefault(step.req_id, reason)

    def _take_rows(
        self, slots: Any, rows: Any, steps: list[Any], columns: slice | None = None
    ) -> None:
        """Route a stage's rows of the step to their requests and store them in one scatter."""
        assert self.arena is not None
        flat = self.router.route_flat(slots, steps)
        entries = [
            None
            if i in flat.failures or not step.scheduled
            else (step.req_id, step.computed_before, step.computed_before + step.scheduled)
            for i, step in enumerate(steps)
        ]
        if columns is None:
            assert self.held is not None
            failures = flat.failures | self.held.write_step(steps, entries, flat, rows)
        else:  # a pipeline stage's columns (no held prefix rows: refused with PP)
            failures = flat.failures | self.arena.write_step(
                entries, flat.rows, flat.owner, flat.positions, rows, columns
            )
        for index, failure in failures.items():
            req_id = steps[index].req_id
            if req_id not in self._row_failures:
                self._row_failures[req_id] = failure
                log.warning("request %s: %s; its sample will fail", req_id, failure)

    def _ingest_failed(self, exc: BaseException) -> None:
        log.error("forward capture: a step's rows could not be stored: %r", exc)

    def _start(self, order: SaveOrder, *, engine_thread: bool = True) -> None:
        """Point the order at the request's arena blocks (or fail it: rows missing)."""
        assert self.arena is not None
        failure = order.failure or self._row_failures.pop(order.req_id, None)
        have = self.arena.filled(order.req_id)
        if failure is None and have < len(order.token_ids):
            failure = f"rows of {have} of {len(order.token_ids)} tokens were captured"
        order = dataclasses.replace(
            order, block_ids=self.arena.blocks(order.req_id), failure=failure
        )
        super()._start(order, engine_thread=engine_thread)

    def shutdown(self) -> None:
        """Rows in flight stored and their saves started (bounded); then the base's."""
        if self.ingest is not None and not self.ingest.stop(self.config.shutdown_timeout):
            log.warning("forward capture: rows still in flight at shutdown were dropped")
        if self.stages is not None:
            self.stages.close(self.config.shutdown_timeout)
        super().shutdown()
        if self.staging is not None:
            self.staging.remove()
