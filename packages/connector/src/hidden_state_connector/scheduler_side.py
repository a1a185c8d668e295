"""Scheduler-side half of the connector: names files, decides what to save, tells workers.

Runs in the scheduler process. It picks each request's file name when the request is
first scheduled (so the worker can create the lock in the same step, long before the
client can learn the name), and when the request finishes it hands the worker a
``SaveOrder`` and returns ``{"hidden_states_path": ...}`` to the client, keeping the KV
blocks until the worker has copied them out.
"""

from __future__ import annotations

import os
from typing import Any

from hidden_state_connector import compat
from hidden_state_connector.config import ConnectorConfig
from hidden_state_connector.logs import get_logger
from hidden_state_connector.metadata import HiddenStateConnectorMetadata, NewSample, SaveOrder
from hidden_state_connector.stats import WriteStats
from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.format import DATA_SUFFIX, resolve_inside, safe_component

log = get_logger(__name__)

PATH_PARAM = "hidden_states_path"
ERROR_PARAM = "hidden_states_error"
INCLUDE_OUTPUT_PARAM = "include_output_tokens"


def instance_tag(config: ConnectorConfig, vllm_config: Any) -> str:
    """The part of default file names that keeps engines and restarts apart."""
    if config.instance_id:
        return safe_component(config.instance_id, 40)
    engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "engine")
    tag = safe_component(engine_id.replace("-", ""), 40)[:8]
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is not None and getattr(parallel, "data_parallel_size", 1) > 1:
        tag += f"-dp{parallel.data_parallel_rank}"
    return tag


class SchedulerSide:
    """State the scheduler-side connector keeps between steps.

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        block_size: Block size of the hidden-state cache group.
        stats: Shared counters.
    """

    def __init__(
        self, config: ConnectorConfig, vllm_config: Any, block_size: int, stats: WriteStats
    ) -> None:
        self.config = config
        self.root = os.path.abspath(config.shared_storage_path)
        self.block_size = block_size
        self.stats = stats
        self.tag = instance_tag(config, vllm_config)
        self._paths: dict[str, str] = {}
        self._paths_in_use: set[str] = set()
        self._outgoing = HiddenStateConnectorMetadata()

    def default_path(self, req_id: str) -> str:
        """Where a request's sample goes unless the client chose a path."""
        return os.path.join(self.root, f"{safe_component(req_id)}.{self.tag}{DATA_SUFFIX}")

    def _choose_path(self, req_id: str, params: dict[str, Any]) -> str:
        requested = params.get(PATH_PARAM)
        if requested is None:
            return self.default_path(req_id)
        if not self.config.allow_custom_save_path:
            log.warning(
                "request %s asked for %s=%r but allow_custom_save_path is off; using %s",
                req_id,
                PATH_PARAM,
                requested,
                self.default_path(req_id),
            )
            self.stats.refused_path()
            return self.default_path(req_id)
        try:
            path = resolve_inside(self.root, requested)
        except PathOutsideRootError as exc:
            log.warning("request %s: %s; using the default name", req_id, exc)
            self.stats.refused_path()
            return self.default_path(req_id)
        if path in self._paths_in_use:
            log.warning("request %s: %s is in use by another request; using default", req_id, path)
            self.stats.refused_path()
            return self.default_path(req_id)
        return path

    def build_metadata(self, scheduler_output: Any) -> HiddenStateConnectorMetadata:
        """Name newly scheduled requests and hand over everything queued for the worker."""
        meta, self._outgoing = self._outgoing, HiddenStateConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            req_id = new_req.req_id
            if req_id in self._paths:
                continue  # resumed after preemption: same file, lock already exists
            path = self._choose_path(req_id, compat.new_request_params(new_req))
            self._paths[req_id] = path
            self._paths_in_use.add(path)
            meta.new_samples.append(NewSample(req_id, path))
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Queue the save of a finished request; keep its blocks until the worker is done."""
        req_id = request.request_id
        path = self._paths.pop(req_id, None)
        if path is None:
            return False, None  # never scheduled: no lock, nothing computed
        self._paths_in_use.discard(path)
        params = request.kv_transfer_params or {}
        include_output = bool(params.get(INCLUDE_OUTPUT_PARAM, self.config.include_output_tokens))
        prompt = list(request.prompt_token_ids or [])
        # The last generated token was never fed back, so it has no hidden state.
        tokens = list(request.all_token_ids)[:-1] if include_output else prompt
        failure = None
        if compat.request_was_aborted(request):
            failure = f"request ended with status {request.status}"
        elif not tokens:
            failure = "request has no token ids (prompt embeddings only?)"
        elif request.num_computed_tokens < len(tokens):
            failure = f"only {request.num_computed_tokens} of {len(tokens)} tokens were computed"
        elif len(block_ids) * self.block_size < len(tokens):
            failure = f"{len(block_ids)} blocks cannot hold {len(tokens)} tokens"
        self._outgoing.saves.append(
            SaveOrder(
                req_id,
                path,
                [] if failure else tokens,
                [] if failure else list(block_ids),
                len(prompt),
                failure,
            )
        )
        result: dict[str, Any] = {PATH_PARAM: path}
        if failure:
            result[ERROR_PARAM] = failure
        # Delay block freeing even for failures: the worker must still release the lock,
        # and reporting the request finished keeps the engine stepping until it has.
        return True, result
