"""Parsing a client's ``loss_mask`` / ``loss_mask_spans`` (engine.loss_mask_param); no vLLM."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from hidden_state_connector.engine.loss_mask_param import requested_mask, stored_mask
from hidden_state_connector.engine.metadata import SaveOrder


def test_no_mask_is_no_mask_even_without_prompt_ids() -> None:
    assert requested_mask({}, None, False) == (None, None)
    assert requested_mask({"loss_mask": None, "other": 1}, 5, True) == (None, None)


def test_json_booleans_count_as_0_and_1() -> None:
    assert requested_mask({"loss_mask": [True, False, 1, 0]}, 4, False) == ([1, 0, 1, 0], None)


def test_spans_are_half_open_unions_in_any_order() -> None:
    mask, error = requested_mask({"loss_mask_spans": [[4, 6], [0, 1], [5, 7], [3, 3]]}, 8, False)
    assert error is None and mask == [1, 0, 0, 0, 1, 1, 1, 0]
    assert requested_mask({"loss_mask_spans": []}, 3, False) == ([0, 0, 0], None)


@pytest.mark.parametrize(
    ("params", "num_prompt", "include_output", "reason"),
    [
        ({"loss_mask": [1, 0]}, None, False, "needs a prompt of token ids"),
        ({"loss_mask": [1, 0.0, 1]}, 3, False, "loss_mask[1] is 0.0; every entry must be 0 or 1"),
        ({"loss_mask": [1, None, 1]}, 3, False, "loss_mask[1] is None"),
        ({"loss_mask": {"0": 1}}, 3, False, "must be a list of 0/1, got dict"),
        ({"loss_mask": [1] * 4}, 3, False, "has 4 entries; expected one per stored token"),
        ({"loss_mask": [1] * 2}, 3, True, "has 2 entries; expected at least the prompt's 3"),
        ({"loss_mask_spans": [[0, 1, 2]]}, 3, False, "expected [start, end] integers"),
        ({"loss_mask_spans": [[True, 2]]}, 3, False, "expected [start, end] integers"),
        ({"loss_mask_spans": [[2, 1]]}, 3, False, "need 0 <= start <= end <= 3"),
        ({"loss_mask_spans": [[-1, 1]]}, 3, False, "need 0 <= start <= end <= 3"),
        ({"loss_mask_spans": "0-3"}, 3, False, "must be a list of [start, end] pairs"),
    ],
)
def test_malformed_masks_give_a_reason_not_an_exception(
    params: dict[str, Any], num_prompt: int | None, include_output: bool, reason: str
) -> None:
    mask, error = requested_mask(params, num_prompt, include_output)
    assert mask is None and error is not None and reason in error


def test_longer_lists_are_accepted_on_arrival_only_when_output_is_stored() -> None:
    assert requested_mask({"loss_mask": [1] * 5}, 3, True) == ([1] * 5, None)
    assert stored_mask([1] * 5, 3, 5) == ([1] * 5, None)
    mask, error = stored_mask([1] * 5, 3, 6)
    assert mask is None and error is not None
    assert "5 entries but 6 tokens are stored (3 prompt, 3 generated); send 3 or 6" in error


def test_a_prompt_length_mask_marks_generated_tokens_trained() -> None:
    assert stored_mask([0, 1, 0], 3, 3) == ([0, 1, 0], None)
    assert stored_mask([0, 1, 0], 3, 5) == ([0, 1, 0, 1, 1], None)


def test_a_save_order_with_a_mask_survives_the_order_channels_json() -> None:
    order = SaveOrder("r", "/x.safetensors", [1, 2, 3], [0], 3, loss_mask=[0, 1, 1])
    assert SaveOrder(**json.loads(json.dumps(asdict(order)))) == order
