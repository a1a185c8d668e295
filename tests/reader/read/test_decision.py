"""Which files a snapshot reads without their lock: complete small files of our writers only.

A lock held by this process through ``WriterLock.create`` is another owner for ``flock``
(its own open file description), so the reader meets it as it meets a writer's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hidden_state_reader import HiddenStateReader, LockTimeoutError, load_sample
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.sample.load import MMAP_MIN_BYTES

from samples import make_tensors, write_samples, write_vllm_style


def _names(reader: HiddenStateReader) -> list[str]:
    return [Path(s.path).name for s in reader]


def test_a_snapshot_takes_a_published_file_whatever_its_lock_says(hs_dir: Path) -> None:
    """Published by rename, the file is final: a writer holding its lock changes nothing."""
    (path,) = write_samples(hs_dir, 1)
    lock = WriterLock.create(str(path))  # e.g. a writer of the next version of this name
    try:
        reader = HiddenStateReader(hs_dir, lock_timeout=0.2, on_error="raise")
        (sample,) = list(reader)
        expected = load_sample(path)
        assert torch.equal(sample.hidden_states, expected.hidden_states)
        assert torch.equal(sample.token_ids, expected.token_ids)
        assert sample.metadata == expected.metadata and sample.layer_ids == expected.layer_ids
        assert reader.stats.yielded == 1 and reader.stats.lock_timeouts == 0
    finally:
        lock.release()


def test_other_writers_files_wait_for_their_lock(hs_dir: Path) -> None:
    """vLLM's connector writes in place under its lock: complete-looking is not final."""
    path = write_vllm_style(hs_dir / "v.safetensors", 0)
    lock = WriterLock.create(str(path))
    try:
        reader = HiddenStateReader(hs_dir, lock_timeout=0.2)
        assert list(reader) == []
        assert reader.stats.lock_timeouts == 1
    finally:
        lock.release()
    assert _names(HiddenStateReader(hs_dir, on_error="raise")) == ["v.safetensors"]


def test_an_incomplete_file_of_ours_waits_for_its_lock(hs_dir: Path) -> None:
    (path,) = write_samples(hs_dir, 1)
    blob = path.read_bytes()
    path.write_bytes(blob[:-8])
    lock = WriterLock.create(str(path))
    try:
        reader = HiddenStateReader(hs_dir, lock_timeout=0.2)
        assert list(reader) == []
        assert reader.stats.lock_timeouts == 1 and reader.stats.incomplete == 0
    finally:
        lock.release()
    with pytest.raises(Exception, match="truncated"):
        list(HiddenStateReader(hs_dir, on_error="raise"))


def test_a_large_file_of_ours_keeps_to_the_lock(hs_dir: Path) -> None:
    tokens = MMAP_MIN_BYTES // (3 * 16 * 2) + 1
    (path,) = write_samples(hs_dir, 1, tokens=tokens)
    assert path.stat().st_size >= MMAP_MIN_BYTES
    lock = WriterLock.create(str(path))
    try:
        with pytest.raises(LockTimeoutError):
            list(HiddenStateReader(hs_dir, lock_timeout=0.2, on_error="raise"))
    finally:
        lock.release()


def test_a_follower_keeps_to_the_lock(hs_dir: Path) -> None:
    (path,) = write_samples(hs_dir, 1)
    lock = WriterLock.create(str(path))
    try:
        reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.3)
        assert list(reader) == []
        assert reader.pending == [path.name]
    finally:
        lock.release()


def test_mixed_writers_all_read_as_stored(hs_dir: Path) -> None:
    """Ours, vLLM's, empty and corrupt files in one directory: each judged as before."""
    ours = write_samples(hs_dir, 3)
    theirs = [write_vllm_style(hs_dir / f"hs_{i}.safetensors", i) for i in (3, 4)]
    write_samples(hs_dir, 1, start=5)
    write_sample(hs_dir / "hs_6.safetensors", *make_tensors(6, tokens=0))  # empty
    (hs_dir / "hs_7.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"not json")
    reader = HiddenStateReader(hs_dir)
    got = {Path(s.path).name: s for s in reader}
    assert sorted(got) == sorted(p.name for p in [*ours, *theirs, hs_dir / "hs_5.safetensors"])
    for name, sample in got.items():
        expected = load_sample(hs_dir / name)
        assert torch.equal(sample.hidden_states, expected.hidden_states)
        assert torch.equal(sample.token_ids, expected.token_ids)
        assert sample.metadata == expected.metadata
    assert (reader.stats.empty, reader.stats.corrupt) == (1, 1)
