"""Speculative decoding's per-sample counts: draft tokens verified, and how many were accepted.

A sample captured beside a drafter (the connector's forward capture with a
``speculative_config``) records, for its generated tokens, how many draft tokens the
target model verified (``Meta.NUM_DRAFT_TOKENS``) and how many of them it accepted
(``Meta.NUM_ACCEPTED_TOKENS``), both decimal strings, ``accepted <= drafted``. A trainer
weights or filters samples by the acceptance rate. Samples without speculation (or
prompt-only samples, written before any draft) carry neither key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hidden_state_reader.format.header import Meta


@dataclass(frozen=True)
class Acceptance:
    """A sample's speculative-decoding counts.

    Attributes:
        drafted: Draft tokens the target model verified while generating the sample.
        accepted: Those it accepted (each saved one target step).
    """

    drafted: int
    accepted: int

    @property
    def rate(self) -> float | None:
        """``accepted / drafted``; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None


def speculation_metadata(drafted: int | None, accepted: int | None) -> dict[str, str]:
    """The metadata entries of a sample's counts (none when not known).

    Raises:
        ValueError: A count is negative, or more were accepted than drafted.
    """
    if drafted is None or accepted is None:
        return {}
    if not 0 <= accepted <= drafted:
        raise ValueError(
            f"accepted {accepted} draft tokens of {drafted}: need 0 <= accepted <= drafted"
        )
    return {Meta.NUM_DRAFT_TOKENS: str(drafted), Meta.NUM_ACCEPTED_TOKENS: str(accepted)}


def sample_acceptance(metadata: Mapping[str, str] | None) -> Acceptance | None:
    """A sample's counts from its ``__metadata__`` (None: not recorded, or malformed)."""
    if not metadata:
        return None
    drafted = metadata.get(Meta.NUM_DRAFT_TOKENS)
    accepted = metadata.get(Meta.NUM_ACCEPTED_TOKENS)
    if drafted is None or accepted is None or not (drafted.isdigit() and accepted.isdigit()):
        return None
    found = Acceptance(int(drafted), int(accepted))
    return found if found.accepted <= found.drafted else None
