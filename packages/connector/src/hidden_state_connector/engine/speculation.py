"""Per-request speculative-decoding counts, as the scheduler half of the connector sees them.

With a ``speculative_config`` each decode step schedules a request's last token plus its
draft tokens (``scheduler_output.scheduled_spec_decode_tokens``); the target model
verifies them, and vLLM rolls ``num_computed_tokens`` back by the rejected ones before it
schedules the request again (or finishes it). So a step's accepted count is where the
request's next step starts (or its ``num_computed_tokens`` at ``request_finished``) less
where its drafts began: the same count vLLM's ``SpecDecodingStats`` takes. Draft slots
padded with ``-1`` (no draft proposed) are not counted as drafted. A step whose outcome
is lost to a preemption (the request restarts from an earlier position) counts in
neither total, so ``accepted <= drafted`` always holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class _Counts:
    drafted: int = 0
    accepted: int = 0
    # The last step with drafts: the position of its first draft and its real drafts.
    pending: tuple[int, int] | None = None


def scheduled_drafts(scheduler_output: Any) -> Mapping[str, Sequence[int]]:
    """Draft token ids scheduled for verification this step, by request (vLLM 0.26-0.34)."""
    return getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}


class DraftCounts:
    """Drafted and accepted tokens of each running request."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}

    def step(
        self, req_id: str, computed_before: int, scheduled: int, drafts: Sequence[int]
    ) -> None:
        """A step of ``req_id``: settle its previous drafts, note this step's."""
        counts = self._counts.setdefault(req_id, _Counts())
        self._settle(counts, computed_before)
        if drafts:
            real = 0
            for token in drafts:  # -1 pads rejected or missing drafts, from the first on
                if token < 0:
                    break
                real += 1
            counts.pending = (computed_before + scheduled - len(drafts), real)

    def finish(self, req_id: str, num_computed_tokens: int) -> tuple[int, int] | None:
        """The request ended: its ``(drafted, accepted)`` totals, forgotten (None: not counted)."""
        counts = self._counts.pop(req_id, None)
        if counts is None:
            return None
        self._settle(counts, num_computed_tokens)
        return counts.drafted, counts.accepted

    @staticmethod
    def _settle(counts: _Counts, computed: int) -> None:
        if counts.pending is None:
            return
        first_draft, real = counts.pending
        counts.pending = None
        accepted = computed - first_draft
        if 0 <= accepted <= real:  # else it was preempted and restarted: not known
            counts.drafted += real
            counts.accepted += accepted
