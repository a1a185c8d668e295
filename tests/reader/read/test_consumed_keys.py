"""Consumed idempotency keys: a consumer that deletes or moves a keyed sample records it.

Real files written by the format's writer, read by real readers (the connector's side,
a retry answered from the record, is tested against a vLLM server in
``tests/connector/test_server.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import Meta
from hidden_state_reader.format.consumed import CONSUMED_DIR, record_path
from hidden_state_reader.read.consumed_keys import is_consumed, read_record

from samples import make_tensors


def _keyed(root: Path, key: str, index: int = 0) -> Path:
    """Write ``KEY.safetensors`` as the connector does: the key in its metadata."""
    token_ids, hidden = make_tensors(index)
    path = root / f"{key}.safetensors"
    write_sample(path, token_ids, hidden, metadata={Meta.IDEMPOTENCY_KEY: key})
    return path


@pytest.mark.parametrize("mode", ["delete", "move"])
def test_consuming_a_keyed_sample_records_its_key(tmp_path: Path, mode: str) -> None:
    _keyed(tmp_path, "run7.row-1")
    token_ids, hidden = make_tensors(9)
    write_sample(tmp_path / "plain.safetensors", token_ids, hidden)  # no key: no record
    got = [s.path for s in HiddenStateReader(tmp_path, on_consumed=mode, claim=True)]
    assert len(got) == 2
    assert os.listdir(tmp_path / CONSUMED_DIR) == ["run7.row-1.safetensors"]
    record = read_record(str(tmp_path), "run7.row-1.safetensors")
    assert record is not None and record.action == mode
    assert record.expires_at - record.consumed_at == pytest.approx(7 * 24 * 3600)
    assert is_consumed(str(tmp_path), "run7.row-1.safetensors")
    assert not (tmp_path / "run7.row-1.safetensors").exists()


def test_a_copy_of_a_consumed_key_is_dropped_unread(tmp_path: Path) -> None:
    _keyed(tmp_path, "k1")
    assert len(list(HiddenStateReader(tmp_path, on_consumed="delete"))) == 1
    # A retry that was in flight publishes a second copy after the first was consumed.
    _keyed(tmp_path, "k1", index=1)
    _keyed(tmp_path, "k2", index=2)
    reader = HiddenStateReader(tmp_path, on_consumed="delete", claim=True)
    assert [os.path.basename(s.path) for s in reader] == ["k2.safetensors"]
    assert not (tmp_path / "k1.safetensors").exists(), "the copy is removed"
    # A keeping reader records nothing and drops nothing.
    _keyed(tmp_path, "k1", index=1)
    assert len(list(HiddenStateReader(tmp_path))) == 1


def test_retention_zero_records_nothing_and_bad_values_are_refused(tmp_path: Path) -> None:
    _keyed(tmp_path, "k")
    list(HiddenStateReader(tmp_path, on_consumed="delete", consumed_key_retention=0))
    assert not (tmp_path / CONSUMED_DIR).exists()
    for bad, words in ((-1, "0 (remember no consumed key) or a positive"), ("7d", "a number")):
        with pytest.raises(ValueError, match=r"consumed_key_retention must be") as info:
            HiddenStateReader(tmp_path, consumed_key_retention=bad)  # type: ignore[arg-type]
        assert words in str(info.value)


def test_a_record_that_cannot_be_written_keeps_the_sample(tmp_path: Path) -> None:
    _keyed(tmp_path, "k")
    (tmp_path / CONSUMED_DIR).write_text("not a directory")
    assert len(list(HiddenStateReader(tmp_path, on_consumed="delete"))) == 1
    assert (tmp_path / "k.safetensors").exists(), "kept: a retry must still find it"


def _clean(root: Path, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "hidden_state_reader.apps.cli.main"),
            *("clean", str(root), "--json", *args),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_clean_removes_expired_records_and_on_request_younger_ones(tmp_path: Path) -> None:
    for key in ("old", "young"):
        _keyed(tmp_path, key)
    list(HiddenStateReader(tmp_path, on_consumed="delete"))
    old = record_path(str(tmp_path), "old.safetensors")
    doc = json.loads(Path(old).read_text())
    doc["expires_at"] = time.time() - 1  # its consumer's retention has passed
    Path(old).write_text(json.dumps(doc))
    report = _clean(tmp_path)
    records = [f for f in report["files"] if f["what"] == "consumed-key record"]  # type: ignore[union-attr]
    assert [(os.path.basename(f["path"]), f["outcome"]) for f in records] == [
        ("old.safetensors", "removed")
    ]
    assert is_consumed(str(tmp_path), "young.safetensors")
    dry = _clean(tmp_path, "--consumed-keys-older-than", "0", "--dry-run")
    assert [f["outcome"] for f in dry["files"]] == ["would remove"]  # type: ignore[index]
    assert is_consumed(str(tmp_path), "young.safetensors")
    _clean(tmp_path, "--consumed-keys-older-than", "0")
    assert os.listdir(tmp_path / CONSUMED_DIR) == []
