"""``ForwardRows``: the worker half of forward capture (TP rank 0 captures and writes).

A ``seam.RowSource`` whose rows come from the forward pass instead of a hidden-state
KV-cache group. Per step (``after_forward``, vLLM's ``wait_for_save``, still inside the
step's forward context) the engine's thread only starts copying the step's staging rows
to the host (``StepTransfer``); the ingest thread then routes them to their requests'
positions in the host arena and starts the saves, strictly after every earlier step's
rows (``IngestThread``). A save's rows are its arena blocks; they go back to the arena
once the save's copies are done (``copied``), also while its request still runs.
Under pipeline parallelism (``stages``) rank 0 of the last stage is the writer, with
every stage's rows; rank 0 of each other stage only sends its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.capture import num_hidden_layers
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.arena import ARENA_BLOCK_TOKENS, RowArena, RowCopies
from hidden_state_connector.engine.forward.ingest import IngestThread
from hidden_state_connector.engine.forward.prefix_rows import HeldPrefixRows
from hidden_state_connector.engine.forward.routing import RowRouter
from hidden_state_connector.engine.forward.stages import Pipeline, join_pipeline
from hidden_state_connector.engine.forward.staging import StepStaging, staging_for
from hidden_state_connector.engine.forward.transfer import StepCopy, StepTransfer
from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.seam import CapturePlan, Saves
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

NOT_INSTALLED = (
    "HiddenStateConnector (capture='forward'): the capture was not installed when "
    "vLLM built the model, so nothing would be captured. vLLM installs it through "
    "this package's plugin (entry point vllm.general_plugins: "
    "hidden_state_connector): if VLLM_PLUGINS is set, add hidden_state_connector "
    "to it; otherwise reinstall hidden-state-connector in vLLM's environment."
)


def one_torch_thread() -> None:
    """Hold this thread's torch CPU operators to one thread.

    A step's routing is many small operators that torch would split over a team of
    threads each; beside the engine's own threads such a team waits for busy cores
    (docs/benchmarks.md, issue 45). Torch applies the setting to this thread and to
    threads that first use torch later; threads already running keep theirs.
    """
    torch.set_num_threads(1)


class ForwardRows:
    """Rows of the forward pass, kept in a host arena (a ``seam.RowSource``).

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        plan: The attention group the slot mapping indexes (its block size, one of its
            layers, whose slot mapping is read) and the captured layer ids, ascending.
    """

    def __init__(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.layer_ids = plan.layer_ids
        self.root = os.path.abspath(config.shared_storage_path)  # for the log line
        self.slot_layer = plan.slot_layer
        self.router = RowRouter(plan.block_size)
        self.staging: StepStaging | None = None
        self.arena: RowArena | None = None
        self.held: HeldPrefixRows | None = None
        self.transfer: StepTransfer | None = None
        self.ingest: IngestThread | None = None
        self._saves: Saves | None = None  # set on the writer
        self._row_failures: dict[str, str] = {}
        self._slot_mappings: Any = None  # this step's, from the forward context
        self.stages: Pipeline | None = None  # pipeline parallel: this stage's part

    def register(
        self, kv_caches: dict[str, torch.Tensor], writes: bool, saves: Saves
    ) -> Extractor | None:
        """Take the staging hooked into the model at its construction; the arena's extractor.

        None on a rank that does not write (another TP rank; a pipeline stage but the
        last, which only sends its rows).
        """
        if not writes:  # the states are replicated; rank 0 captures them
            return None
        # Under pipeline parallelism every stage joins the channel first: one that fails
        # below then fails vLLM's start-up instead of leaving the others waiting for it.
        self.stages = join_pipeline(
            self.layer_ids,
            num_hidden_layers(getattr(self.vllm_config, "model_config", None)) or 0,
            max(600.0, self.config.shutdown_timeout),
        )
        self.staging = staging_for(self.vllm_config)
        if self.staging is None:
            raise RuntimeError(NOT_INSTALLED)
        if not self.stages.plan.is_last:  # no locks, saves or reports: the last stage's
            self.stages.start_sending(self.staging.rows)
            return None
        extractor = self._host_rows()
        self.transfer = StepTransfer(self.staging.rows)
        log.info(
            "forward capture: %.1f MiB of host buffers for rows in flight",
            self.transfer.host_bytes / 2**20,
        )
        self.ingest = IngestThread("hidden-state-ingest", self._ingest_failed, one_torch_thread)
        self._saves = saves
        return extractor

    def _host_rows(self) -> Extractor:
        """Build the host arena (and its held prefix rows); the extractor over it."""
        assert self.staging is not None
        model_config = self.vllm_config.model_config
        hidden = int(model_config.get_hidden_size())
        dtype = model_config.dtype
        layers = len(self.layer_ids)
        self.arena = RowArena(
            self.config.capture_buffer_bytes, ARENA_BLOCK_TOKENS, layers, hidden, dtype
        )
        self.held = HeldPrefixRows(self.arena, int(self.vllm_config.cache_config.block_size))
        layout = CacheLayout(1, ARENA_BLOCK_TOKENS, layers, hidden)
        extractor = Extractor.for_settings(self.arena.data, layout, self.config)
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
        return extractor

    def before_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """A new step: the last step's slot mappings no longer apply."""
        self._slot_mappings = None

    def bind_forward(self, forward_context: Any, attn_metadata: Any) -> None:
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
        if self.ingest is None:
            return
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

    def queue_saves(self, orders: Iterable[SaveOrder], *, engine_thread: bool) -> None:
        """Saves whose rows were computed earlier: started after the rows in flight."""
        if self.ingest is not None:
            queued = list(orders)
            self.ingest.put(lambda: self._ingest(None, [], queued))
        elif self._saves is not None:
            self._saves.start_saves(orders, engine_thread=engine_thread)

    def rows_of(self, order: SaveOrder) -> tuple[list[int], str | None]:
        """The request's arena blocks; missing rows name the save's failure."""
        assert self.arena is not None
        failure = self._row_failures.pop(order.req_id, None)
        have = self.arena.filled(order.req_id)
        if failure is None and have < len(order.token_ids):
            failure = f"rows of {have} of {len(order.token_ids)} tokens were captured"
        return self.arena.blocks(order.req_id), failure

    def copied(self, req_ids: set[str]) -> set[str]:
        """Saves copied out of the arena: their blocks go back now, not at the request's end.

        A prompt-only sample is ordered in the step that computes its prompt's last token
        and no later step routes rows to it, so its blocks are free while the request
        goes on decoding.
        """
        if self.arena is None:
            return set()
        for req_id in req_ids:
            self.arena.release(req_id)
        return set(req_ids)

    def close(self, timeout: float) -> None:
        """Rows in flight stored and their saves started (bounded); the hooks off."""
        if self.ingest is not None and not self.ingest.stop(timeout):
            log.warning("forward capture: rows still in flight at shutdown were dropped")
        if self.stages is not None:
            self.stages.close(timeout)
        if self.staging is not None:
            self.staging.remove()

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
            assert self._saves is not None
            with self._saves.mutex:
                self._saves.start_saves(orders, engine_thread=False)
                if released and self.held is not None:
                    self.held.release(released)

    def _ingest_rows(self, copy: StepCopy, steps: list[Any]) -> None:
        assert self.transfer is not None and self.stages is not None and self.arena is not None
        try:
            shape = (int(self.arena.data.shape[-1]), self.arena.data.dtype)
            parts = self.stages.parts(copy, bool(steps), shape, partial(self._fail_rows, steps))
            copy.wait()
            assert self._saves is not None
            copies: RowCopies = []
            with self._saves.mutex, torch.inference_mode():
                for columns, slots, rows in parts:
                    self._take_rows(slots, rows, steps, columns, copies)
            # The bytes move without the lock, which the engine's thread takes every step
            # (a prefill step's rows are hundreds of MiB); this step's saves start after.
            for copy_rows in copies:
                copy_rows()
        except Exception as exc:  # their samples fail with the reason; the engine runs on
            self._fail_rows(steps, f"rows not stored: {exc!r}")
            raise
        finally:
            self.transfer.done(copy)

    def _fail_rows(self, steps: list[Any], reason: str) -> None:
        assert self._saves is not None
        with self._saves.mutex:
            for step in steps:
                self._row_failures.setdefault(step.req_id, reason)

    def _take_rows(
        self,
        slots: Any,
        rows: Any,
        steps: list[Any],
        columns: slice | None,
        copies: RowCopies,
    ) -> None:
        """Route a stage's rows of the step to their requests and place them (``copies``)."""
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
            failures = flat.failures | self.held.write_step(steps, entries, flat, rows, copies)
        else:  # a pipeline stage's columns (no held prefix rows: refused with PP)
            failures = flat.failures | self.arena.write_step(
                entries, flat.rows, flat.owner, flat.positions, rows, columns, copies
            )
        for index, failure in failures.items():
            req_id = steps[index].req_id
            if req_id not in self._row_failures:
                self._row_failures[req_id] = failure
                log.warning("request %s: %s; its sample will fail", req_id, failure)

    def _ingest_failed(self, exc: BaseException) -> None:
        log.error("forward capture: a step's rows could not be stored: %r", exc)
