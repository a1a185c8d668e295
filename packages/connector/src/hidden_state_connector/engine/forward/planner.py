"""Forward capture's scheduler half (a ``seam.RowPlanner``): ``StepRows``, prefix caching.

The scheduler half (``SchedulerSide``) names files, orders saves and keeps each
request's block table for both capture engines; forward capture also tells the worker,
per step, which captured requests' tokens the step computes and the blocks that hold
them (``StepRows``) and, with prefix caching, which held prefix rows a request starts
from and which full blocks it fills (``PrefixRowIndex``). Beside a drafter it counts
each request's drafted and accepted tokens (``DraftCounts``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.admission import ArenaAdmission
from hidden_state_connector.engine.forward.arena import ARENA_BLOCK_TOKENS
from hidden_state_connector.engine.forward.prefix_rows import PrefixCounters, PrefixRowIndex
from hidden_state_connector.engine.forward.routing import rows_of_step
from hidden_state_connector.engine.metadata import (
    HiddenStateConnectorMetadata,
    SaveOrder,
    StepRows,
)
from hidden_state_connector.engine.output_tokens import output_tokens_refusal
from hidden_state_connector.engine.speculation import DraftCounts, scheduled_drafts
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


def _token_bytes(config: ConnectorConfig, vllm_config: Any) -> int:
    """Bytes of one token's captured rows (every captured layer)."""
    model_config = vllm_config.model_config
    layers = len(set(config.layer_ids or ()))
    return layers * int(model_config.get_hidden_size()) * model_config.dtype.itemsize


def _admission(config: ConnectorConfig, vllm_config: Any, prefix_held: bool) -> ArenaAdmission:
    """The count of the arena's blocks: the worker's arena, less the held prefixes' bound."""
    block_bytes = ARENA_BLOCK_TOKENS * _token_bytes(config, vllm_config)
    held = config.prefix_rows_budget // block_bytes if prefix_held else 0
    arena = max(1, config.capture_buffer_bytes // block_bytes)  # as RowArena sizes it
    return ArenaAdmission(max(1, arena - held), ARENA_BLOCK_TOKENS, block_bytes)


def _prefix_index(config: ConnectorConfig, vllm_config: Any) -> PrefixRowIndex | None:
    """The held-prefix index of an engine with prefix caching on (None: off)."""
    if not getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
        return None
    token_bytes = _token_bytes(config, vllm_config)
    block_tokens = int(vllm_config.cache_config.block_size)
    max_blocks = config.prefix_rows_budget // max(1, block_tokens * token_bytes)
    log.info(
        "forward capture: prefix caching on; rows of up to %d blocks of %d tokens held "
        "(prefix_rows_bytes %d)",
        max_blocks,
        block_tokens,
        config.prefix_rows_budget,
    )
    return PrefixRowIndex(block_tokens, max_blocks)


class ForwardPlanner:
    """What forward capture adds to the scheduler half.

    Args:
        config: Validated connector settings (``capture="forward"``).
        vllm_config: The engine's configuration.
        block_size: Block size of the attention group the worker routes rows through.
    """

    def __init__(self, config: ConnectorConfig, vllm_config: Any, block_size: int) -> None:
        self.block_size = block_size
        self.output_tokens_refusal = output_tokens_refusal(vllm_config, forward=True)
        self.prefix = _prefix_index(config, vllm_config)
        self.admission = _admission(config, vllm_config, self.prefix is not None)
        speculating = getattr(vllm_config, "speculative_config", None) is not None
        self.drafts = DraftCounts() if speculating else None
        self._recompute: list[Any] = []  # requests to skip the prefix cache from next step

    def admits(self, request: Any, hit_tokens: int) -> bool:
        """Whether a request may start now: room in the arena, rows of its prefix-cache hit.

        Without room for its prompt's rows it waits (``ArenaAdmission``). Without held
        rows for its hit (vLLM's local hit) it waits a step and is then told to skip the
        prefix cache (``end_step``), so it computes every token and its sample has every
        row. (Told now, vLLM 0.32 would drop the wait and take the hit as it is.)
        """
        if not self.admission.admits(request.request_id, int(request.num_prompt_tokens)):
            return False
        if self.prefix is None or self.prefix.admits(request, hit_tokens):
            return True
        self._recompute.append(request)
        log.debug(
            "request %s: rows of its %d cached tokens are not all held; it recomputes them",
            request.request_id,
            hit_tokens,
        )
        return False

    def plan_step(
        self,
        meta: HiddenStateConnectorMetadata,
        step: compat.ScheduledRequest,
        block_table: list[int],
        counted: Any,
    ) -> None:
        """A captured request's ``StepRows`` for this step, into ``meta.steps``.

        ``counted``: the step's scheduler output, for a request whose drafted and accepted
        tokens are counted (it stores its generated tokens; ``count_drafts`` at its end).
        """
        meta.steps.append(self.step_rows(step, block_table, counted))

    def step_rows(
        self, step: compat.ScheduledRequest, block_table: list[int], counted: Any = None
    ) -> StepRows:
        """A captured request's ``StepRows`` for this step (see ``plan_step``)."""
        if self.drafts is not None and counted is not None:
            drafts = scheduled_drafts(counted).get(step.req_id, ())
            self.drafts.step(step.req_id, step.computed_before, step.scheduled, drafts)
        self.admission.grow(step.req_id, step.computed_before + step.scheduled)
        rows = rows_of_step(step, block_table, self.block_size)
        if self.prefix is not None:
            rows.cached_rows, rows.filled_rows = self.prefix.step(
                step.req_id, step.computed_before, step.scheduled, step.replaces_table
            )
        return rows

    def end_step(self, meta: HiddenStateConnectorMetadata, scheduler_output: Any) -> None:
        """End of the step's metadata: its batch size, prefix rows over the bound, recomputes.

        The worker lets go of the dropped rows after this step; requests refused their
        hit in this step skip the prefix cache from the next.
        """
        if meta.steps:
            meta.batch_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        for request in self._recompute:
            request.skip_reading_prefix_cache = True
        self._recompute.clear()
        if self.prefix is not None:
            meta.released_rows = self.prefix.take_released()

    def forget(self, req_id: str) -> None:
        """A request ended (its rows count until ``freed``)."""
        self.admission.forget(req_id)
        if self.prefix is not None:
            self.prefix.forget(req_id)

    def freed(self, req_ids: Iterable[str]) -> None:
        """The worker is done with these requests' rows (their copies are done)."""
        self.admission.freed(req_ids)

    def count_drafts(self, order: SaveOrder, request: Any) -> None:
        """A finish-time order: the request's drafted and accepted tokens, beside a drafter.

        Every request counted (``step_rows``) ends in one: it stores its generated tokens.
        """
        if self.drafts is None:
            return
        counts = self.drafts.finish(request.request_id, int(request.num_computed_tokens))
        if counts is not None and order.failure is None:
            order.num_draft_tokens, order.num_accepted_tokens = counts

    @property
    def counters(self) -> PrefixCounters | None:
        """Prefix caching's counters (None: off)."""
        return None if self.prefix is None else self.prefix.counters
