"""``HiddenStateConnector``: the class vLLM instantiates, once per role.

A thin adapter: vLLM's KV-connector interface on one side, ``SchedulerSide`` and
``WorkerSide`` (``hidden_state_connector.engine``) on the other, both built by the
factory (``engine.engines``), which picks the capture engine (``engine.forward`` by
default, ``engine.extract`` beside vLLM's ``extract_hidden_states``) and the storage
medium (``engine.sinks``). Store-only; it branches on neither. This module's path is
``CONNECTOR_MODULE``, the one the plugin registers and users pass as
``kv_connector_module_path``; importing it imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

# The connector API; its module path is the one vLLM 0.26-0.34 share. This module and
# ``engine.metrics`` are the only modules run in the engine that need vLLM importable.
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from hidden_state_connector.engine import compat, engines
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, RowsLetGo
from hidden_state_connector.engine.scheduler_side import SchedulerSide
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.worker_side import WorkerSide
from hidden_state_connector.engine.write.sample_file import PRODUCTION_HOOKS, WriteHooks

if TYPE_CHECKING:
    from hidden_state_connector.engine.metrics import HiddenStateConnectorStats


class HiddenStateConnector(KVConnectorBase_V1, SupportsHMA):
    """Writes each request's captured hidden states to ``NAME.safetensors``.

    Configure through ``kv_connector_extra_config`` (see ``ConnectorConfig``). Clients get
    the file path in ``kv_transfer_params["hidden_states_path"]`` and can sleep on
    ``LOCK_SH`` of ``path + ".lock"`` until it is complete.

    Attributes:
        write_hooks: The write path's seams (``WriteHooks``), for benchmarks and profilers:
            a subclass sets its own (``benchmarks/null_sink.py``'s ``DiscardConnector``
            writes nothing). Both capture engines write through them.
    """

    write_hooks: ClassVar[WriteHooks] = PRODUCTION_HOOKS

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        compat.check_vllm_version()
        # Our per-step metadata is a plain dataclass (importable without vLLM): make it a
        # KVConnectorMetadata for vLLM's type checks (an empty ABC; registering is idempotent).
        KVConnectorMetadata.register(HiddenStateConnectorMetadata)
        compat.register_worker_metadata(RowsLetGo)
        self.config = engines.choose_capture(
            ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config),
            vllm_config,
        )
        # Refuses, by name, what the capture engine cannot capture (run before the model
        # loaded too, where vLLM loaded the plugin).
        plan = engines.plan_capture(vllm_config, kv_cache_config, self.config)
        stage, stages = compat.pipeline_stage()  # the last stage's TP rank 0 writes
        writes = compat.tensor_parallel_rank() == 0 and stage == stages - 1
        # Raises StorageRootError (naming shared_storage_path), so vLLM does not start.
        engines.check_storage(self.config, writes_here=role == KVConnectorRole.SCHEDULER or writes)
        self._group = plan.group
        self._stats = WriteStats(self.config.stats_interval)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._let_go: list[str] = []  # for the scheduler half (build_connector_worker_meta)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = engines.scheduler_side(self.config, vllm_config, plan, self._stats)
        else:
            self._worker = engines.worker_side(
                self.config, vllm_config, plan, self._stats, self.write_hooks
            )

    # -- shared -----------------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """Sleep mode is supported (vLLM >= 0.33 asks; older releases never do).

        Every copy in flight finishes before the cache is released (``SleepGuard``).
        """
        return True

    def get_finished_count(self) -> int:
        """Only TP rank 0 reports; one report per request frees its blocks."""
        return 1

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """No requirement: the cache layout is probed at start-up, whatever it is."""
        return None

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """Keep the hidden-state cache separate from the model's KV cache (vLLM 0.26)."""
        return False

    # -- worker side ------------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before sleep releases the cache (vLLM >= 0.33): finish every copy in flight."""
        if self._worker is not None:
            self._worker.sleep.before_release(self._worker.pipeline)

    def restore_kv_caches(self) -> None:
        """After wake-up (vLLM >= 0.33): the cache is back at its addresses; capture on."""
        if self._worker is not None:
            self._worker.sleep.after_restore()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Locate the hidden-state cache and start the write pipeline."""
        assert self._worker is not None
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: finish copying blocks vLLM freed by preemption.

        vLLM 0.26-0.34 call this before every forward pass, before binding the step's
        metadata (``start_load_kv`` runs after the forward pass since 0.32).
        """
        if self._worker is not None and isinstance(
            kv_connector_metadata, HiddenStateConnectorMetadata
        ):
            self._worker.before_forward(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Store-only: nothing to load. The capture engine may keep the forward context."""
        if self._worker is not None:
            self._worker.bind_forward(forward_context, kwargs.get("attn_metadata"))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Store-only: nothing to load."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: the cache-only layer already stored the hidden states."""

    def _metadata(self) -> HiddenStateConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, HiddenStateConnectorMetadata) else None

    def wait_for_save(self) -> None:
        """After the step's forward pass: create new locks, start this step's saves.

        vLLM calls this after the drafter stored the step's hidden states, and before
        the client can learn any new name.
        """
        meta = self._metadata()
        if self._worker is not None and meta is not None:
            self._worker.after_forward(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Start saves of finished requests; report those whose blocks may be freed."""
        if self._worker is None:
            return None, None
        done, let_go = self._worker.get_finished(self._metadata(), finished_req_ids)
        self._let_go += let_go
        return done, None

    def build_connector_worker_meta(self) -> Any:
        """To the scheduler half: requests whose rows this worker let go of (``RowsLetGo``).

        vLLM 0.26-0.34 ask after every step; the scheduler half then counts their rows
        no more (forward capture's back-pressure), even while they still run.
        """
        let_go, self._let_go = self._let_go, []
        return RowsLetGo(let_go) if let_go else None

    def shutdown(self) -> None:
        """Drain queued writes (bounded by ``shutdown_timeout``) and release every lock."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def get_kv_connector_stats(self) -> HiddenStateConnectorStats | None:
        """Counters since the last call, for vLLM's metrics logging."""
        from hidden_state_connector.engine.metrics import HiddenStateConnectorStats

        data = self._stats.take_interval()
        return HiddenStateConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiddenStateConnectorStats | None:
        """Rebuild stats sent from workers."""
        from hidden_state_connector.engine.metrics import HiddenStateConnectorStats

        return HiddenStateConnectorStats(data=dict(data or {}))

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Store-only: never provides tokens.

        A capture engine may refuse a prefix-cache hit (forward capture, whose cached
        prefix's rows are not held): the request waits a step (None), then computes them.
        """
        if self._scheduler is not None and not self._scheduler.rows.admits(
            request, num_computed_tokens
        ):
            return None, False
        return 0, False

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report: requests whose rows are let go of count no more.

        Requests reported finished (``finished_sending``), and those whose samples were
        copied out while they still run (``RowsLetGo``, ``build_connector_worker_meta``).
        """
        if self._scheduler is not None:
            self._scheduler.rows.freed(getattr(connector_output, "finished_sending", None) or ())
            let_go = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(let_go, RowsLetGo):
                self._scheduler.rows.freed(let_go.req_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Store-only: nothing to track."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Tell the worker which locks to create and which samples to save."""
        assert self._scheduler is not None
        return self._scheduler.build_metadata(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Queue the save of a finished request and return its path to the client."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid-allocator variant: pick the hidden-state group's blocks."""
        if not 0 <= self._group < len(block_ids):
            return self.request_finished(request, [])
        return self.request_finished(request, block_ids[self._group])
