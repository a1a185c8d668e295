"""The scheduler half's drafted/accepted counts (``engine/speculation.py``), step by step.

The positions are what vLLM's scheduler reports: a decode step schedules the last token
plus its drafts from ``computed_before``, and the next step starts where the rejected
drafts were rolled back to (checked against vLLM's own per-request counts in
``tests/connector/test_forward_speculative.py``).
"""

from __future__ import annotations

from hidden_state_connector.engine.speculation import DraftCounts


def test_accepted_drafts_are_where_the_next_step_starts() -> None:
    counts = DraftCounts()
    counts.step("a", 0, 10, [])  # prefill: no drafts
    counts.step("a", 10, 4, [7, 8, 9])  # token 10 + 3 drafts at 11-13
    counts.step("a", 13, 4, [1, 2, 3])  # 2 accepted (11, 12); 13 is the bonus token
    counts.step("a", 14, 1, [])  # none accepted; no drafts this step
    assert counts.finish("a", 15) == (6, 2)


def test_the_last_step_is_settled_at_finish_and_padding_is_not_drafted() -> None:
    counts = DraftCounts()
    counts.step("a", 5, 4, [4, -1, -1])  # one real draft, two -1 pads
    assert counts.finish("a", 7) == (1, 1)  # finished with num_computed_tokens 7
    assert counts.finish("unknown", 3) is None  # never counted: no counts recorded


def test_a_step_lost_to_preemption_counts_in_neither_total() -> None:
    counts = DraftCounts()
    counts.step("a", 20, 3, [1, 2])
    counts.step("a", 0, 16, [])  # preempted: recomputed from 0, outcome unknown
    assert counts.finish("a", 16) == (0, 0)
