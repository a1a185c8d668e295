"""The extract engine's scheduler half: nothing to add to a step.

vLLM's drafter stores every scheduled token's rows in the hidden-state cache group, so
the worker needs no per-step word about rows; a save order names the request's blocks
(``SchedulerSide`` keeps the table). Prefix caching shares blocks, rows included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.output_tokens import output_tokens_refusal
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


class ExtractPlanner:
    """A ``seam.RowPlanner`` with nothing to plan.

    Args:
        vllm_config: The engine's configuration (for the refusal of generated tokens).
        layer_ids: Captured layer ids.
    """

    def __init__(self, vllm_config: Any, layer_ids: list[int]) -> None:
        self.output_tokens_refusal = output_tokens_refusal(vllm_config, forward=False)
        if 0 in layer_ids and torch.cuda.is_available():
            log.warning(
                "layer id 0 (embeddings) is unreliable on CUDA: vLLM's fused add-RMSNorm "
                "updates the captured tensor in place (seen with vLLM 0.26 on an H200). "
                "Capture layers >= 1."
            )

    def admits(self, request: Any, hit_tokens: int) -> bool:
        """Always: a prefix-cache hit shares the cached blocks' rows."""
        return True

    def plan_step(
        self,
        meta: HiddenStateConnectorMetadata,
        step: Any,
        block_table: list[int],
        counted: Any,
    ) -> None:
        """Nothing: the save order carries the request's blocks."""

    def end_step(self, meta: HiddenStateConnectorMetadata, scheduler_output: Any) -> None:
        """Nothing."""

    def forget(self, req_id: str) -> None:
        """Nothing is kept per request."""

    def freed(self, req_ids: Iterable[str]) -> None:
        """Nothing is counted: the rows live in vLLM's KV cache."""

    def count_drafts(self, order: SaveOrder, request: Any) -> None:
        """Not counted: the extract engine is the speculative method."""
