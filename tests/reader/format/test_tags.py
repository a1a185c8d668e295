"""Client tags and idempotency keys: the format's rules, and tags through a real file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hidden_state_reader import load_sample
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import (
    Meta,
    check_tags,
    keyed_sample_name,
    sample_metadata,
    sample_tags,
    tag_metadata,
)
from hidden_state_reader.format.tags import MAX_TAG_KEY_CHARS, RESERVED_KEYS


def test_tags_written_with_a_sample_read_back_as_metadata_entries(tmp_path: Path) -> None:
    tags, problem = check_tags({"policy_version": "step-3", "row.id": "42"})
    assert problem is None
    path = tmp_path / "a.safetensors"
    meta = sample_metadata(layer_ids=[1], request_id="r", extra=tag_metadata(tags))
    write_sample(path, torch.arange(2), torch.zeros(2, 1, 4), metadata=meta)
    sample = load_sample(str(path))
    assert sample.metadata["policy_version"] == "step-3" and sample.metadata["row.id"] == "42"
    assert sample_tags(sample.metadata) == tags
    assert sample.metadata[Meta.REQUEST_ID] == "r"  # the format's own keys are untouched


def test_a_file_without_tags_or_with_a_broken_list_has_none() -> None:
    assert sample_tags({Meta.REQUEST_ID: "r"}) == {}
    assert sample_tags({Meta.TAG_KEYS: "not json", "a": "1"}) == {}
    assert sample_tags({Meta.TAG_KEYS: '{"a": 1}', "a": "1"}) == {}
    assert tag_metadata(None) == {} and tag_metadata({}) == {}


def test_every_format_key_is_reserved() -> None:
    assert {Meta.REQUEST_ID, Meta.LAYER_IDS, Meta.CRC32, Meta.TAG_KEYS} <= RESERVED_KEYS
    for key in RESERVED_KEYS:
        assert check_tags({key: "x"})[1] is not None


@pytest.mark.parametrize(
    ("key", "name"),
    [("row-1", "row-1.safetensors"), ("a.b_c", "a.b_c.safetensors"), ("9", "9.safetensors")],
)
def test_a_key_names_its_sample(key: str, name: str) -> None:
    assert keyed_sample_name(key) == (name, None)


@pytest.mark.parametrize("key", ["", ".hidden", "a/b", "a b", "x" * 201, "a.tmp.1", None])
def test_a_key_that_cannot_name_a_sample_is_refused(key: object) -> None:
    name, problem = keyed_sample_name(key)
    assert name == "" and problem is not None and "idempotency_key" in problem


def test_a_long_key_is_refused_with_the_limit_named() -> None:
    _, problem = check_tags({"k" * (MAX_TAG_KEY_CHARS + 1): "x"})
    assert problem is not None and f"at most {MAX_TAG_KEY_CHARS} characters" in problem
