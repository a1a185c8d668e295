"""Scheduler-side half of the connector: names files, decides what to save, tells workers.

Runs in the scheduler process. It picks each request's file name when the request is
first scheduled (so the worker can create the lock in the same step, long before the
client can learn the name) and orders the save as early as the hidden states are
complete:

- prompt-only capture (the default): in the step that computes the prompt's last
  token. The worker starts the save right after that step's forward pass, so the file
  is published without any further engine step (an in-process ``LLM`` takes none once
  its outputs are done).
- with generated tokens (``include_output_tokens``): when the request finishes, since
  only then is it known which tokens are the last. The order goes straight to the
  writing worker: in the same process (``handoff.same_process``) or over a local socket
  (``handoff.socket_channel``); else in the next step's metadata.

``request_finished`` returns ``{"hidden_states_path": ...}`` to the client (with the
Mooncake Store backend ``hidden_states_key`` and ``hidden_states_url`` instead) and keeps
the KV blocks until the worker has copied them out. It is the one home of a request's
block table. What differs between capture engines is the ``RowPlanner``
(``engine.seam``), between media the ``SinkIndex``; ``engine.engines`` builds both.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.handoff import same_process
from hidden_state_connector.engine.handoff.socket_channel import OrderSender
from hidden_state_connector.engine.loss_mask_param import requested_mask, stored_mask
from hidden_state_connector.engine.metadata import (
    HiddenStateConnectorMetadata,
    NewSample,
    SaveOrder,
)
from hidden_state_connector.engine.sample_params import (
    EXISTED_PARAM,
    KEY_PARAM,
    keyed_path,
    requested_tags,
)
from hidden_state_connector.engine.seam import RowPlanner, SinkIndex
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.logs import get_logger
from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.files.paths import resolve_inside
from hidden_state_reader.format import DATA_SUFFIX, safe_component

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


@dataclass
class _Tracked:
    """What the scheduler half remembers of a request between its first step and its end."""

    path: str
    prompt: list[int] | None
    include_output: bool
    keyed: bool = False  # its name comes from an idempotency key
    block_ids: list[int] = field(default_factory=list)
    ordered: bool = False  # a save order was sent before the request finished
    failure: str | None = None  # why the sample cannot be written
    refused: bool = False  # refused when scheduled: no lock, no order, nothing held
    loss_mask: list[int] | None = None  # the client's mask, as far as checked on arrival
    tags: dict[str, str] | None = None  # the client's checked tags (``metadata``)
    found: bool = False  # its idempotency key names a sample already complete: no write

    @property
    def holds_nothing(self) -> bool:
        """No lock, no save order, no blocks kept: refused, or found complete."""
        return self.refused or self.found


class SchedulerSide:
    """State the scheduler-side connector keeps between steps.

    Built by ``engine.engines.scheduler_side``.

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        block_size: Block size of the KV-cache group whose blocks hold the rows.
        group: Index of that group.
        stats: Shared counters.
        rows: The capture engine's scheduler half.
        index: The storage medium's scheduler half.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        vllm_config: Any,
        block_size: int,
        group: int,
        stats: WriteStats,
        *,
        rows: RowPlanner,
        index: SinkIndex,
    ) -> None:
        self.config = config
        self.root = os.path.abspath(config.shared_storage_path)
        self.block_size = block_size
        self.group = group
        self.stats = stats
        self.tag = instance_tag(config, vllm_config)
        self.engine_key = compat.engine_key(vllm_config)
        self._sender = OrderSender(self.engine_key)
        self._requests: dict[str, _Tracked] = {}
        self._paths_in_use: Counter[str] = Counter()  # requests in flight per path
        self._outgoing = HiddenStateConnectorMetadata()
        self.rows = rows
        self.index = index

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
        """Name new requests, order the saves this step completes, hand over the queue."""
        meta, self._outgoing = self._outgoing, HiddenStateConnectorMetadata()
        new_params = {
            new.req_id: compat.new_request_params(new)
            for new in scheduler_output.scheduled_new_reqs
        }
        for step in compat.scheduled_requests(scheduler_output, self.group, self._settled):
            tracked = self._requests.get(step.req_id)
            if tracked is None:
                if step.req_id not in new_params:
                    continue  # not ours (should not happen)
                tracked = self._track(step, new_params[step.req_id])
                if tracked.holds_nothing:
                    continue
                meta.new_samples.append(NewSample(step.req_id, tracked.path))
            if tracked.holds_nothing:
                continue
            if step.new_block_ids is not None and not tracked.ordered:
                if step.replaces_table:
                    tracked.block_ids = step.new_block_ids
                else:
                    tracked.block_ids.extend(step.new_block_ids)
            if not tracked.ordered:
                counted = scheduler_output if tracked.include_output else None  # its drafts
                self.rows.plan_step(meta, step, tracked.block_ids, counted)
            if tracked.ordered or tracked.include_output or not tracked.prompt:
                continue
            if step.computed_before + step.scheduled >= len(tracked.prompt):
                meta.saves.append(self._prompt_order(step.req_id, tracked))
        self.rows.end_step(meta, scheduler_output)
        for req_id in compat.preempted_request_ids(scheduler_output):
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.ordered:
                meta.preempted.append(req_id)
        return meta

    def _settled(self, req_id: str) -> bool:
        """A request a step changes nothing for: not ours, holding nothing, or ordered."""
        tracked = self._requests.get(req_id)
        return tracked is None or tracked.ordered or tracked.holds_nothing

    def _track(self, step: compat.ScheduledRequest, params: dict[str, Any]) -> _Tracked:
        keyed, problem = keyed_path(self.root, params, PATH_PARAM)
        if keyed is not None and self._written_without_key(keyed):
            problem = f"{KEY_PARAM} names {keyed!r}, which a request without that key is writing"
        path = keyed or self._choose_path(step.req_id, params)
        self._paths_in_use[path] += 1
        include = bool(params.get(INCLUDE_OUTPUT_PARAM, self.config.include_output_tokens))
        tracked = _Tracked(path, step.prompt_token_ids, include, keyed=keyed is not None)
        self._requests[step.req_id] = tracked
        if problem is None and path != self.default_path(step.req_id):
            # A client-chosen directory: find out now, not when the writer fails. (The
            # store backend writes no directory: the path only names the store key.)
            reason = self.index.unusable(path)
            if reason is not None:
                problem = f"{PATH_PARAM} {path!r} cannot be written: {reason}"
                self.stats.refused_path()
        if problem is None and include and self.rows.output_tokens_refusal is not None:
            problem = self.rows.output_tokens_refusal
        if problem is None:
            tracked.tags, problem = requested_tags(params)
        if problem is None:
            prompt = step.prompt_token_ids
            mask, problem = requested_mask(params, None if prompt is None else len(prompt), include)
            tracked.loss_mask = mask
        if problem is not None:
            # Refused before any lock: a sample without its mask would silently train on
            # every token, one without its tags could not be told apart.
            tracked.refused, tracked.failure = True, problem
            log.warning("request %s: %s; no sample is written", step.req_id, problem)
        elif keyed is not None and self._written(keyed):
            # A retry of a request whose sample is complete (or consumed within its key's
            # retention): answer with it, write nothing.
            tracked.found = True
            log.info("request %s: %s is written already (idempotency key)", step.req_id, keyed)
        return tracked

    def _written(self, path: str) -> bool:
        """Whether the keyed sample bound for ``path`` is written (or consumed)."""
        return self.index.written(path)

    def _written_without_key(self, path: str) -> bool:
        """Whether a request in flight writes ``path`` under a name no key gave it."""
        if not self._paths_in_use[path]:
            return False
        return any(t.path == path and not t.keyed for t in self._requests.values())

    def _prompt_order(self, req_id: str, tracked: _Tracked) -> SaveOrder:
        """The save of a prompt whose last token this step computes."""
        assert tracked.prompt is not None
        tracked.ordered = True
        order = SaveOrder(
            req_id,
            tracked.path,
            tracked.prompt,
            list(tracked.block_ids),
            len(tracked.prompt),
            written_this_step=True,
            loss_mask=tracked.loss_mask,
            tags=tracked.tags,
        )
        if len(order.block_ids) * self.block_size < len(order.token_ids):
            tracked.failure = order.failure = (
                f"{len(order.block_ids)} blocks cannot hold {len(order.token_ids)} tokens"
            )
            order.token_ids, order.block_ids, order.loss_mask = [], [], None
        return order

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Order the save of a finished request (unless ordered already); keep its blocks.

        A request whose blocks are freed now is one the worker holds nothing for: the row
        source stops counting it here (the others: when the worker reports them).
        """
        delay, result = self._finish(request, block_ids)
        if not delay:
            self.rows.freed((request.request_id,))
        return delay, result

    def _finish(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.rows.forget(req_id)
        tracked = self._requests.pop(req_id, None)
        if tracked is None:
            return False, None  # never scheduled: no lock, nothing computed
        self._paths_in_use[tracked.path] -= 1
        if self._paths_in_use[tracked.path] <= 0:
            del self._paths_in_use[tracked.path]
        # Files: the sample's path. The store: its key and URL, and no path (nothing is
        # ever written there, so a path would send the client to a file that never exists).
        store = self.index.client_params(tracked.path)
        result: dict[str, Any] = dict(store) if store else {PATH_PARAM: tracked.path}
        if tracked.refused:  # the worker holds nothing for it: free the blocks now
            return False, result | {ERROR_PARAM: tracked.failure}
        if tracked.found:
            return False, result | {EXISTED_PARAM: True}
        if tracked.ordered:
            # Its prompt was complete and is being written; what happened after (more
            # decoding, an abort) does not change those hidden states. A write that
            # failed meanwhile is told now where the worker shares this process.
            failure = tracked.failure or same_process.known_failure(self.engine_key, req_id)
            if failure:
                result[ERROR_PARAM] = failure
            return True, result
        order = _finish_order(request, tracked, block_ids, self.block_size)
        self.rows.count_drafts(order, request)  # beside a drafter: drafted, accepted
        if order.failure:
            result[ERROR_PARAM] = order.failure
        self._deliver(order)
        # Delay block freeing even for failures: the worker must still release the lock,
        # and reporting the request finished keeps the engine stepping until it has.
        return True, result

    def _deliver(self, order: SaveOrder) -> None:
        """Get a finish-time order to the writing worker without waiting for a step."""
        deliver = same_process.find(self.engine_key)
        if deliver is not None:
            deliver(order)  # same process: started now
        elif not self._sender.send(order):
            self._outgoing.saves.append(order)  # next step's metadata

    def shutdown(self) -> None:
        """Close the order channel (and the medium's index)."""
        self._sender.close()
        self.index.close()


def _finish_order(
    request: Any, tracked: _Tracked, block_ids: list[int], block_size: int
) -> SaveOrder:
    """The save of a request that finished (or a failure order naming why it cannot be)."""
    prompt = list(request.prompt_token_ids or [])
    # The last generated token was never fed back, so it has no hidden state.
    tokens = list(request.all_token_ids)[:-1] if tracked.include_output else prompt
    failure = None
    if compat.request_was_aborted(request):
        failure = f"request ended with status {request.status}"
    elif not tokens:
        failure = "request has no token ids (prompt embeddings only?)"
    elif request.num_computed_tokens < len(tokens):
        failure = f"only {request.num_computed_tokens} of {len(tokens)} tokens were computed"
    elif len(block_ids) * block_size < len(tokens):
        failure = f"{len(block_ids)} blocks cannot hold {len(tokens)} tokens"
    mask = tracked.loss_mask
    if failure is None and mask is not None:
        mask, failure = stored_mask(mask, len(prompt), len(tokens))
    return SaveOrder(
        request.request_id,
        tracked.path,
        [] if failure else tokens,
        [] if failure else list(block_ids),
        len(prompt),
        failure,
        loss_mask=None if failure else mask,
        tags=tracked.tags,
    )
