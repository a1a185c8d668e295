"""The factory: the one reader of ``capture`` and ``storage_backend``.

Like vLLM's offloading connector, which builds one spec for both of its halves, this
module picks the capture engine (``choose_capture``: forward by default, extract beside
vLLM's ``extract_hidden_states``) and the storage medium, runs the engine's refusals,
and builds both halves with their parts: ``WorkerSide`` with the engine's ``RowSource``
and the medium's ``Sink``, ``SchedulerSide`` with the engine's ``RowPlanner`` and the
medium's ``SinkIndex`` (``engine.seam``). A third engine or medium is one more entry in
``ENGINES`` or ``MEDIA`` (docs/contributing.md). The facade (``connector.py``) imports
this module and the halves, nothing engine-specific.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Protocol

from hidden_state_connector.engine.capture import num_hidden_layers
from hidden_state_connector.engine.config import CAPTURE_EXTRACT, CAPTURE_FORWARD, ConnectorConfig
from hidden_state_connector.engine.cpu_build import amx_mla_dtype_refusal
from hidden_state_connector.engine.extract import checks as extract_checks
from hidden_state_connector.engine.extract.planner import ExtractPlanner
from hidden_state_connector.engine.extract.rows import ExtractRows
from hidden_state_connector.engine.forward.checks import EXTRACT_METHOD, forward_setup
from hidden_state_connector.engine.forward.planner import ForwardPlanner
from hidden_state_connector.engine.forward.rows import ForwardRows
from hidden_state_connector.engine.scheduler_side import SchedulerSide
from hidden_state_connector.engine.seam import CapturePlan, RowPlanner, RowSource, Sink, SinkIndex
from hidden_state_connector.engine.sinks.files import FilesIndex, FilesSink
from hidden_state_connector.engine.sinks.mooncake import StoreBackend, StoreLookup
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.storage_check import check_storage_root
from hidden_state_connector.engine.worker_side import WorkerSide
from hidden_state_connector.engine.write.sample_file import PRODUCTION_HOOKS, WriteHooks
from hidden_state_connector.layers import default_layer_ids
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


# -- the choice ---------------------------------------------------------------------


def speculative_method(vllm_config: Any) -> str | None:
    """The engine's speculative method (None: no speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else getattr(spec, "method", None)


def default_forward_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three auxiliary layers and the last one (pre-norm)."""
    return tuple(sorted({*default_layer_ids(num_layers), num_layers}))


def choose_capture(config: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """``config`` with its capture engine and (forward) its layer ids decided.

    A config with no ``capture`` runs forward capture, unless the engine runs vLLM's
    ``extract_hidden_states`` speculative method (configs written before forward capture
    existed keep their engine). Forward capture with no ``layer_ids`` captures EAGLE-3's
    layers and the last one, ``[2, N/2, N-3, N]``.

    Raises:
        ValueError: Forward capture with no ``layer_ids`` of a model whose layer count
            vLLM does not give; the message names the key.
    """
    capture = config.capture
    if capture is None:
        extract = speculative_method(vllm_config) == EXTRACT_METHOD
        capture = CAPTURE_EXTRACT if extract else CAPTURE_FORWARD
    layer_ids = config.layer_ids
    if capture == CAPTURE_EXTRACT and layer_ids is not None:
        raise ValueError(
            "layer_ids: only for forward capture; the extract engine takes its layers from "
            "speculative_config (eagle_aux_hidden_state_layer_ids)"
        )
    if capture == CAPTURE_FORWARD and not layer_ids:
        n = num_hidden_layers(vllm_config.model_config)
        if not n:
            raise ValueError(
                "layer_ids: this model's number of layers is unknown, so forward capture has "
                "no default layers; set kv_connector_extra_config.layer_ids (e.g. [2, 16, 29])"
            )
        layer_ids = default_forward_layers(n)
    return dataclasses.replace(config, capture=capture, layer_ids=layer_ids)


# -- the engines ----------------------------------------------------------------------


class EngineEntry(Protocol):
    """A capture engine's factory entry: its refusals, its plan, its two parts."""

    hooks_model: bool  # hooked into the model while vLLM builds it (``forward.install``)

    def refuse(self, vllm_config: Any, config: ConnectorConfig) -> None:
        """Raise ``ValueError`` naming what this engine cannot capture (before the load)."""

    def plan(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> CapturePlan:
        """Where the rows are indexed and which layers are captured."""

    def rows(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowSource:
        """The worker half's part."""

    def planner(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowPlanner:
        """The scheduler half's part."""


class MediumEntry(Protocol):
    """A storage medium's factory entry: its two parts."""

    checks_root: bool  # ``shared_storage_path`` is probed at start-up

    def sink(self, config: ConnectorConfig, root: str) -> Sink:
        """The worker half's part, joined (raises: start-up fails)."""

    def index(self, config: ConnectorConfig, root: str) -> SinkIndex:
        """The scheduler half's part."""


class _Extract:
    """The extract engine's entry (``engine/extract/``)."""

    hooks_model = False

    def refuse(self, vllm_config: Any, config: ConnectorConfig) -> None:
        extract_checks.refuse_unsupported(vllm_config, config)

    def plan(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> CapturePlan:
        setup = extract_checks.extract_setup(vllm_config, kv_cache_config)
        return CapturePlan(setup.group, setup.block_size, setup.layer_ids, setup.configured)

    def rows(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowSource:
        return ExtractRows(config, vllm_config, plan)

    def planner(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowPlanner:
        return ExtractPlanner(vllm_config, plan.layer_ids)


class _Forward:
    """Forward capture's entry (``engine/forward/``)."""

    hooks_model = True

    def refuse(self, vllm_config: Any, config: ConnectorConfig) -> None:
        forward_setup(vllm_config, None, config)

    def plan(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> CapturePlan:
        setup = forward_setup(vllm_config, kv_cache_config, config)
        configured = list(config.layer_ids or ())
        return CapturePlan(
            setup.group, setup.block_size, setup.layer_ids, configured, setup.slot_layer
        )

    def rows(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowSource:
        return ForwardRows(config, vllm_config, plan)

    def planner(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> RowPlanner:
        return ForwardPlanner(config, vllm_config, plan.block_size)


ENGINES: dict[str, EngineEntry] = {CAPTURE_EXTRACT: _Extract(), CAPTURE_FORWARD: _Forward()}
"""Each ``capture`` value's entry: refusals, plan, and both halves' parts."""


def _engine(config: ConnectorConfig) -> EngineEntry:
    """The entry of ``config``'s engine (undecided, as in unit tests' fakes: extract)."""
    return ENGINES[config.capture or CAPTURE_EXTRACT]


def hooks_model(config: ConnectorConfig) -> bool:
    """Whether the engine hooks the model while vLLM builds it (``forward.install``)."""
    return _engine(config).hooks_model


def refuse_unsupported(vllm_config: Any, config: ConnectorConfig) -> None:
    """Refuse, by name, an engine whose model or settings its capture engine cannot capture.

    Run before vLLM loads the model (the plugin, ``forward.install``), and again when the
    connector starts, for processes where the plugin was not loaded: the capture
    engine's own refusals first (they are final), then the CPU build's choices that a
    change of dtype or backend avoids.

    Raises:
        ValueError: ``ForwardCaptureError`` or ``UnsupportedArchitectureError`` (both
            ``ValueError``); the message names the setting or the model and what works.
    """
    from hidden_state_connector.engine.architecture import UnsupportedArchitectureError

    _engine(config).refuse(vllm_config, config)
    reason = amx_mla_dtype_refusal(vllm_config)
    if reason is not None:
        raise UnsupportedArchitectureError(f"HiddenStateConnector: {reason}")


def plan_capture(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> CapturePlan:
    """Refuse what the engine cannot capture, then plan its capture (both roles)."""
    refuse_unsupported(vllm_config, config)
    return _engine(config).plan(vllm_config, kv_cache_config, config)


# -- the media ------------------------------------------------------------------------


class _Files:
    """``storage_backend="files"`` (``engine/sinks/files.py``)."""

    checks_root = True

    def sink(self, config: ConnectorConfig, root: str) -> Sink:
        return FilesSink(root, lock=config.use_synchronization_lock)

    def index(self, config: ConnectorConfig, root: str) -> SinkIndex:
        return FilesIndex()


class _Mooncake:
    """``storage_backend="mooncake"`` (``engine/sinks/mooncake.py``)."""

    checks_root = False

    def sink(self, config: ConnectorConfig, root: str) -> Sink:
        return StoreBackend(config, root)  # raises: start-up fails

    def index(self, config: ConnectorConfig, root: str) -> SinkIndex:
        return StoreLookup(config, root)


MEDIA: dict[str, MediumEntry] = {"files": _Files(), "mooncake": _Mooncake()}
"""Each ``storage_backend`` value's entry: both halves' parts."""


def check_storage(config: ConnectorConfig, *, writes_here: bool) -> None:
    """Where this process names or writes samples, check the medium before vLLM starts.

    Raises:
        StorageRootError: ``shared_storage_path`` is unusable (the message names it).
    """
    if writes_here and MEDIA[config.storage_backend].checks_root:
        check_storage_root(config.shared_storage_path)


# -- the halves -----------------------------------------------------------------------


def scheduler_side(
    config: ConnectorConfig, vllm_config: Any, plan: CapturePlan, stats: WriteStats
) -> SchedulerSide:
    """The scheduler half, with its engine's planner and its medium's index."""
    if plan.layer_ids != plan.configured:
        log.warning(
            "eagle_aux_hidden_state_layer_ids %s are captured in the order %s; files "
            "record that order in their layer_ids metadata",
            plan.configured,
            plan.layer_ids,
        )
    root = os.path.abspath(config.shared_storage_path)
    return SchedulerSide(
        config,
        vllm_config,
        plan.block_size,
        plan.group,
        stats,
        rows=_engine(config).planner(config, vllm_config, plan),
        index=MEDIA[config.storage_backend].index(config, root),
    )


def worker_side(
    config: ConnectorConfig,
    vllm_config: Any,
    plan: CapturePlan,
    stats: WriteStats,
    hooks: WriteHooks = PRODUCTION_HOOKS,
) -> WorkerSide:
    """The worker half, with its engine's row source and its medium's sink."""
    root = os.path.abspath(config.shared_storage_path)
    medium = MEDIA[config.storage_backend]
    open_sink: Callable[[], Sink] = lambda: medium.sink(config, root)  # noqa: E731
    return WorkerSide(
        config,
        vllm_config,
        plan.layer_ids,
        stats,
        rows=_engine(config).rows(config, vllm_config, plan),
        open_sink=open_sink,
        hooks=hooks,
    )
