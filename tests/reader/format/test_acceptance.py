"""The format's speculative-decoding counts: written as two decimal keys, read back checked."""

from __future__ import annotations

import pytest

from hidden_state_reader.format import Acceptance, Meta, sample_acceptance, speculation_metadata
from hidden_state_reader.format.tags import RESERVED_KEYS


def test_counts_round_trip_and_are_not_client_tags() -> None:
    meta = speculation_metadata(12, 9)
    assert meta == {Meta.NUM_DRAFT_TOKENS: "12", Meta.NUM_ACCEPTED_TOKENS: "9"}
    assert sample_acceptance(meta) == Acceptance(12, 9)
    assert Acceptance(12, 9).rate == 0.75 and Acceptance(0, 0).rate is None
    assert {Meta.NUM_DRAFT_TOKENS, Meta.NUM_ACCEPTED_TOKENS} <= RESERVED_KEYS
    assert speculation_metadata(None, None) == {}


def test_malformed_counts_read_as_absent_and_are_never_written() -> None:
    assert sample_acceptance({}) is None
    assert sample_acceptance({Meta.NUM_DRAFT_TOKENS: "3"}) is None
    assert sample_acceptance({Meta.NUM_DRAFT_TOKENS: "3", Meta.NUM_ACCEPTED_TOKENS: "x"}) is None
    assert sample_acceptance({Meta.NUM_DRAFT_TOKENS: "3", Meta.NUM_ACCEPTED_TOKENS: "4"}) is None
    with pytest.raises(ValueError, match="accepted 4 draft tokens of 3"):
        speculation_metadata(3, 4)
