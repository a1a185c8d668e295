"""The extract engine's worker half: a save's rows are its blocks in vLLM's cache group.

The cache-only layer that vLLM's drafter writes holds every captured layer's rows; its
layout is probed once, and the write pipeline copies a request's blocks out of it. A
preempted request's blocks may be reused by the next forward pass, so its copies are
finished first (``before_forward``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.capture import num_hidden_layers
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.seam import CapturePlan, Saves
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


class ExtractRows:
    """Rows in the hidden-state KV-cache group (a ``seam.RowSource``).

    Args:
        config: Validated connector settings.
        vllm_config: The engine's configuration.
        plan: The hidden-state cache group's block size and the captured layer ids.
    """

    def __init__(self, config: ConnectorConfig, vllm_config: Any, plan: CapturePlan) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.block_size = plan.block_size
        self.layer_ids = plan.layer_ids
        self.root = os.path.abspath(config.shared_storage_path)  # for the log line
        self._saves: Saves | None = None  # set on the writing rank
        self._extractor: Extractor | None = None

    def register(
        self, kv_caches: dict[str, torch.Tensor], writes: bool, saves: Saves
    ) -> Extractor | None:
        """Find the cache-only layer, probe its layout; its extractor (writing rank)."""
        layer_name = compat.find_cache_only_layer(self.vllm_config, kv_caches)
        kv_cache = kv_caches[layer_name]
        layout = compat.probe_layout(kv_cache, self.block_size, len(self.layer_ids))
        extractor = Extractor.for_settings(kv_cache, layout, self.config)
        blocks_per_chunk = extractor.blocks_per_chunk
        log.info(
            "HiddenStateConnector: %s, layers %s of %s, hidden %d, %s; cache %s (token axis "
            "%d), %d blocks (%d tokens) per chunk; writing to %s%s",
            kv_cache.device,
            self.layer_ids,
            num_hidden_layers(getattr(self.vllm_config, "model_config", None)) or "?",
            layout.hidden_size,
            f"{kv_cache.dtype} stored as {extractor.storage}",
            tuple(kv_cache.shape),
            layout.token_axis,
            blocks_per_chunk,
            blocks_per_chunk * layout.block_size,
            self.root,
            "" if writes else " (not this TP rank)",
        )
        if not writes:
            return None
        self._saves, self._extractor = saves, extractor
        return extractor

    def before_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Finish the copies of preempted requests' samples before their blocks are reused."""
        if self._saves is not None and meta.preempted:
            self._saves.flush(set(meta.preempted))

    def bind_forward(self, forward_context: Any, attn_metadata: Any) -> None:
        """Nothing: the drafter stores the rows in the cache."""

    def after_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Mark how far the model's stream has got; start the saves this step completed."""
        if self._saves is None or self._extractor is None:
            return
        with self._saves.mutex:  # as every thread that gathers from the cache
            self._extractor.mark_step()
            if meta.saves:
                self._saves.start_saves(
                    (order for order in meta.saves if order.written_this_step),
                    engine_thread=True,
                )

    def queue_saves(self, orders: Iterable[SaveOrder], *, engine_thread: bool) -> None:
        """Start them now: their rows are in the cache already."""
        if self._saves is not None:
            self._saves.start_saves(orders, engine_thread=engine_thread)

    def rows_of(self, order: SaveOrder) -> tuple[list[int], str | None]:
        """The request's blocks in the cache group, as the scheduler half ordered them."""
        return order.block_ids, None

    def copied(self, req_ids: set[str]) -> set[str]:
        """Nothing: the blocks are vLLM's, freed once the requests are reported."""
        return set()

    def close(self, timeout: float) -> None:
        """Nothing runs here."""
