"""One sample-state rule: the reader, len(), stats, verify, clean and inspect agree."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, HiddenStateReader
from hidden_state_reader.apps.cli import main as cli_main
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample

from samples import make_tensors, write_samples

PAST = time.time() - 3600


def _age(path: Path) -> None:
    os.utime(path, (PAST, PAST))


def _mixed(root: Path) -> WriterLock:
    """Three ready samples and one of every other state; returns the held writer lock."""
    write_samples(root, 3)
    token_ids, hidden = make_tensors(9, tokens=4)
    write_sample(root / "empty.safetensors", token_ids[:0], hidden[:0])
    (root / "garbage.safetensors").write_bytes(os.urandom(300))
    blob = (root / "hs_0.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(blob[:-10])
    _age(root / "truncated.safetensors")
    failed = WriterLock.create(str(root / "failed.safetensors"), request_id="req-f")
    failed.mark_failed("out of disk space")
    failed.release()
    _age(root / "failed.safetensors.lock")
    stale = WriterLock.create(str(root / "stale.safetensors"))
    stale.release()
    _age(root / "stale.safetensors.lock")
    (root / "x.safetensors.tmp.4242.dead").write_bytes(b"half")
    _age(root / "x.safetensors.tmp.4242.dead")
    return WriterLock.create(str(root / "pending.safetensors"), request_id="req-p")


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main.main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_len_stats_verify_clean_and_the_reader_agree(
    hs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pending = _mixed(hs_dir)
    try:
        rc, stats = _cli_json(capsys, "stats", str(hs_dir))
        assert rc == 0
        assert stats["count"] == 3
        assert stats["states"] == {
            "ready": 3,
            "pending": 1,
            "failed": 1,
            "stale": 1,
            "incomplete": 1,
            "corrupt": 1,
            "empty": 1,
        }
        usable = stats["states"]["ready"] + stats["states"]["pending"]
        dataset = HiddenStateDataset(hs_dir)
        assert len(dataset) == usable
        assert len(HiddenStateLoader(HiddenStateDataset(hs_dir), batch_size=2)) == 2

        rc, report = _cli_json(capsys, "verify", str(hs_dir))
        assert rc == 1
        problems = {p["name"]: p["state"] for p in report["problems"]}
        assert problems == {
            "empty.safetensors": "empty",
            "garbage.safetensors": "corrupt",
            "truncated.safetensors": "incomplete",
            "failed.safetensors": "failed",
            "stale.safetensors": "stale",
            "x.safetensors.tmp.4242.dead": "orphan_temp",
        }

        # clean removes exactly what verify calls leftovers, and says what it kept and why.
        rc, cleaned = _cli_json(capsys, "clean", str(hs_dir))
        assert rc == 0
        actions = {os.path.basename(f["path"]): f["outcome"] for f in cleaned["files"]}
        assert actions == {
            "failed.safetensors.lock": "removed",
            "stale.safetensors.lock": "removed",
            "x.safetensors.tmp.4242.dead": "removed",
            "pending.safetensors.lock": "kept",
            "empty.safetensors": "kept",
            "garbage.safetensors": "kept",
            "truncated.safetensors": "kept",
        }
        kept = {os.path.basename(f["path"]): f["detail"] for f in cleaned["files"]}
        assert "still being written" in kept["pending.safetensors.lock"]
        assert "never removes data files" in kept["garbage.safetensors"]
        rc, report = _cli_json(capsys, "verify", str(hs_dir))
        assert {p["state"] for p in report["problems"]} == {"empty", "corrupt", "incomplete"}

        # The writer finishes; the reader yields exactly the usable samples.
        write_sample(hs_dir / "pending.safetensors", *make_tensors(5), use_lock=False)
    finally:
        pending.release()
    reader = HiddenStateReader(hs_dir)
    names = sorted(os.path.basename(s.path) for s in reader)
    assert len(names) == usable
    assert names == sorted(dataset.epoch_names())
    assert (reader.stats.empty, reader.stats.corrupt, reader.stats.incomplete) == (1, 1, 1)


def test_inspect_shows_a_failed_or_pending_sample_from_its_lock(
    hs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = WriterLock.create(str(hs_dir / "f.safetensors"), request_id="req-f")
    failed.mark_failed("engine shut down before the request finished", request_id="req-f")
    failed.release()
    rc, info = _cli_json(capsys, "inspect", str(hs_dir / "f.safetensors"))
    assert rc == 1
    assert info["state"] == "failed"
    assert info["lock_status"]["reason"] == "engine shut down before the request finished"
    assert info["lock_status"]["request_id"] == "req-f"
    held = WriterLock.create(str(hs_dir / "p.safetensors"), request_id="req-p")
    try:
        capsys.readouterr()
        assert cli_main.main(["inspect", str(hs_dir / "p.safetensors.lock")]) == 0
        out = capsys.readouterr().out
        assert "pending: writer holds the lock" in out and "req-p" in out
    finally:
        held.release()


def test_no_samples_is_a_warning_naming_the_directory_and_what_is_there(
    hs_dir: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    (hs_dir / "notes.txt").write_text("x")
    (hs_dir / "run1").mkdir()
    write_samples(hs_dir / "run1", 2)
    with caplog.at_level(logging.WARNING):
        assert list(HiddenStateReader(hs_dir)) == []
    text = caplog.text
    assert str(hs_dir) in text and "1 other file" in text
    assert "sub-folders (run1)" in text
    assert cli_main.main(["verify", str(hs_dir)]) == 1, "a script must notice"
    assert "no samples found" in capsys.readouterr().out
    assert cli_main.main(["stats", str(hs_dir)]) == 1
