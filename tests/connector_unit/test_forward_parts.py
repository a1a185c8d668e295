"""Forward capture's parts without an engine: its config keys, row routing, the host arena."""

from __future__ import annotations

import pytest
import torch

from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.forward.arena import ArenaFullError, RowArena
from hidden_state_connector.engine.forward.routing import RowRouter
from hidden_state_connector.engine.metadata import StepRows


def test_capture_keys_are_checked_by_name() -> None:
    cfg = ConnectorConfig.from_extra_config({"capture": "forward", "layer_ids": [4, 1]})
    assert cfg.capture == "forward" and cfg.layer_ids == (4, 1)
    assert ConnectorConfig.from_extra_config({}).capture == "extract"
    with pytest.raises(ValueError, match="layer_ids: capture='forward' needs"):
        ConnectorConfig.from_extra_config({"capture": "forward"})
    with pytest.raises(ValueError, match="layer_ids: expected a list"):
        ConnectorConfig.from_extra_config({"capture": "forward", "layer_ids": "1,2"})
    with pytest.raises(ValueError, match="layer_ids: only for capture='forward'"):
        ConnectorConfig.from_extra_config({"layer_ids": [1]})
    with pytest.raises(ValueError, match="capture: must be"):
        ConnectorConfig.from_extra_config({"capture": "hooks"})


def test_rows_are_routed_by_slot_whatever_the_batch_order() -> None:
    router = RowRouter(block_size=4)
    # a: prefill chunk, tokens [0, 6) in blocks 7, 2; b: decode of token 9 (block 5, slot 1).
    steps = [StepRows("a", 0, 6, [7, 2], True), StepRows("b", 9, 1, [3, 8, 5], True)]
    router.update(steps)
    # The runner put b first and padded the batch to 8 rows (slot -1).
    slots = torch.tensor([5 * 4 + 1, 7 * 4, 7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, -1])
    routed = router.route(slots, steps)
    assert routed["b"].rows.tolist() == [0] and routed["b"].positions.tolist() == [9]
    assert routed["a"].rows.tolist() == [1, 2, 3, 4, 5, 6]
    assert routed["a"].positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert routed["a"].failure is None and routed["b"].failure is None


def test_missing_rows_fail_the_request_not_store_wrong_ones() -> None:
    router = RowRouter(block_size=4)
    steps = [StepRows("a", 0, 3, [7], True)]
    router.update(steps)
    routed = router.route(torch.tensor([7 * 4, 7 * 4 + 1, -1]), steps)
    assert routed["a"].failure is not None and "expected 3" in routed["a"].failure


def test_arena_stores_by_position_and_reports_gaps_and_full() -> None:
    arena = RowArena(
        2 * 4 * 2 * 3 * 4, block_size=4, num_layers=2, hidden_size=3, dtype=torch.float32
    )
    assert arena.num_blocks == 2
    rows = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    assert arena.write("a", torch.arange(5), rows) is None
    assert arena.filled("a") == 5 and len(arena.blocks("a")) == 2
    # Recomputed after a preemption: the same positions, overwritten.
    assert arena.write("a", torch.arange(2), rows[:, :2]) is None
    flat = arena.data[arena.blocks("a")].reshape(-1, 2, 3)
    assert torch.equal(flat[:5], rows.transpose(0, 1))
    with pytest.raises(ArenaFullError):
        arena.write("b", torch.arange(1), rows[:, :1])
    arena.release("a")
    assert arena.write("b", torch.arange(6, 7), rows[:, :1]) is not None  # rows [0, 6) missing
