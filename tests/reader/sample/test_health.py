"""health: every state, on real files, with locks held by a real separate process."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from hidden_state_reader.files.listing import list_entries
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import LockState
from hidden_state_reader.sample.health import (
    PROBLEM_STATES,
    check_sample,
    check_temp,
    count_states,
    scan_health,
    temp_owner_lock,
)
from hidden_state_reader.sample.states import GRACE, SampleState

from procs import LockHolder
from samples import make_tensors, write_raw, write_samples, write_vllm_style

PAST = time.time() - 3600


def age(path: Path, when: float = PAST) -> None:
    os.utime(path, (when, when))


# -- ready --------------------------------------------------------------------------


def test_ready_samples_ours_and_vllm(hs_dir: Path) -> None:
    write_samples(hs_dir, 2, tokens=[5, 9], layers=4, hidden=32, layer_ids=[2, 5, 9, 11])
    write_vllm_style(hs_dir / "vllm_0.safetensors", 0, tokens=7, layers=3)

    ours = check_sample(hs_dir, "hs_1.safetensors")
    assert ours.state is SampleState.READY and ours.ok and not ours.problem
    assert ours.reason == ""
    assert ours.lock is LockState.FREE  # our writer leaves its released lock file
    assert ours.header is not None
    assert (ours.header.num_tokens, ours.header.num_layers, ours.header.hidden_size) == (9, 4, 32)
    assert ours.header.layer_ids == [2, 5, 9, 11]
    assert ours.size == os.path.getsize(hs_dir / "hs_1.safetensors")
    assert ours.path == str(hs_dir / "hs_1.safetensors")
    assert ours.lock_path == str(hs_dir / "hs_1.safetensors.lock")
    d = ours.as_dict()
    assert d["state"] == "ready" and d["tokens"] == 9 and d["dtype"] == "BF16"
    assert d["kind"] == "sample" and d["lock"] == "free"

    vllm = check_sample(hs_dir, "vllm_0.safetensors")
    assert vllm.state is SampleState.READY
    assert vllm.lock is LockState.ABSENT and vllm.lock_status is None
    assert vllm.header is not None and vllm.header.num_tokens == 7

    # The lock-file name is accepted for the sample.
    assert check_sample(hs_dir, "hs_0.safetensors.lock").name == "hs_0.safetensors"


def test_zero_tokens_is_empty_and_nonfinite_is_ready_with_a_note(hs_dir: Path) -> None:
    token_ids, hidden = make_tensors(0, tokens=4)
    hidden[1, 0, 0] = float("nan")
    write_sample(hs_dir / "nan.safetensors", token_ids, hidden)
    write_sample(hs_dir / "zero.safetensors", token_ids[:0], hidden[:0])
    nan = check_sample(hs_dir, "nan.safetensors")
    assert nan.state is SampleState.READY and "NaN" in nan.reason
    zero = check_sample(hs_dir, "zero.safetensors")
    assert zero.state is SampleState.EMPTY and "zero tokens" in zero.reason


# -- bad data files -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "state", "words"),
    [
        ("truncated", SampleState.INCOMPLETE, "truncated"),
        ("header_cut", SampleState.INCOMPLETE, "inside the header"),
        ("zero_length", SampleState.INCOMPLETE, "empty file"),
        ("garbage", SampleState.CORRUPT, "implausible"),
        ("trailing", SampleState.CORRUPT, "trailing bytes"),
        ("wrong_dtype", SampleState.CORRUPT, "hidden_states has dtype I64"),
        ("missing_tensor", SampleState.CORRUPT, "missing tensor 'token_ids'"),
        ("length_mismatch", SampleState.CORRUPT, "length mismatch"),
        ("bad_json", SampleState.CORRUPT, "not valid JSON"),
    ],
)
def test_bad_data_files(hs_dir: Path, make: str, state: SampleState, words: str) -> None:
    good = write_samples(hs_dir, 1)[0].read_bytes()
    path = hs_dir / f"{make}.safetensors"
    if make == "truncated":
        path.write_bytes(good[:-100])
    elif make == "header_cut":
        path.write_bytes(good[:40])
    elif make == "zero_length":
        path.write_bytes(b"")
    elif make == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif make == "trailing":
        path.write_bytes(good + b"\0" * 16)
    elif make == "wrong_dtype":
        write_raw(
            path, {"hidden_states": (torch.int64, (4, 3, 8)), "token_ids": (torch.int64, (4,))}
        )
    elif make == "missing_tensor":
        write_raw(path, {"hidden_states": (torch.float32, (4, 3, 8))})
    elif make == "length_mismatch":
        write_raw(
            path, {"hidden_states": (torch.float32, (4, 3, 8)), "token_ids": (torch.int64, (5,))}
        )
    elif make == "bad_json":
        path.write_bytes((8).to_bytes(8, "little") + b"{not js}")
    age(path)  # no lock protects these files, so only age says nobody writes them

    health = check_sample(hs_dir, path.name)
    assert health.state is state
    assert words in health.reason
    assert health.problem and health.header is None
    assert health.size == path.stat().st_size


def test_unlocked_truncated_file_is_pending_while_young(hs_dir: Path) -> None:
    good = write_samples(hs_dir, 1)[0].read_bytes()
    path = hs_dir / "growing.safetensors"
    path.write_bytes(good[:-100])
    now = time.time()
    young = check_sample(hs_dir, path.name, now=now)
    assert young.state is SampleState.PENDING and "may still be appending" in young.reason
    later = check_sample(hs_dir, path.name, now=now + GRACE + 1)
    assert later.state is SampleState.INCOMPLETE
    assert check_sample(hs_dir, path.name, grace=0).state is SampleState.INCOMPLETE


def test_truncated_file_with_a_released_lock_is_incomplete_at_once(hs_dir: Path) -> None:
    good = write_samples(hs_dir, 1)[0]
    good.write_bytes(good.read_bytes()[:-100])  # its (free) lock file stays
    health = check_sample(hs_dir, good.name)
    assert health.state is SampleState.INCOMPLETE and health.lock is LockState.FREE


def test_checksums(hs_dir: Path) -> None:
    token_ids, hidden = make_tensors(3)
    write_sample(hs_dir / "crc_ok.safetensors", token_ids, hidden, checksum=True)
    bad = Path(write_sample(hs_dir / "crc_bad.safetensors", token_ids, hidden, checksum=True))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    write_samples(hs_dir, 1, checksum=False)  # no CRC recorded (an older writer's file)

    assert check_sample(hs_dir, "crc_bad.safetensors").state is SampleState.READY
    checked = check_sample(hs_dir, "crc_bad.safetensors", checksums=True)
    assert checked.state is SampleState.CORRUPT and "CRC32 mismatch" in checked.reason
    ok = check_sample(hs_dir, "crc_ok.safetensors", checksums=True)
    assert ok.state is SampleState.READY and ok.checksum_verified
    plain = check_sample(hs_dir, "hs_0.safetensors", checksums=True)
    assert plain.state is SampleState.READY and not plain.checksum_verified


# -- locks --------------------------------------------------------------------------


def test_held_lock_is_pending_never_blocks(hs_dir: Path, holder: LockHolder) -> None:
    data = hs_dir / "held.safetensors"
    holder.lock(data)
    try:
        start = time.monotonic()
        health = check_sample(hs_dir, data.name)
        # A blocking check would sleep until the holder lets go: any bound catches it.
        assert time.monotonic() - start < 10
        assert health.state is SampleState.PENDING and not health.problem
        assert health.lock is LockState.HELD
        assert f"pid {holder.proc.pid}" in health.reason
        # An old lock is still pending while held (a slow writer is not a dead one).
        age(hs_dir / "held.safetensors.lock")
        assert check_sample(hs_dir, data.name).state is SampleState.PENDING
        # vLLM writes in place under its lock: a partial data file is not "incomplete".
        good = write_samples(hs_dir, 1)[0].read_bytes()
        data.write_bytes(good[:-100])
        age(data)
        assert check_sample(hs_dir, data.name).state is SampleState.PENDING
    finally:
        holder.release(data)
    # Released with the partial file in place: now it is incomplete.
    assert check_sample(hs_dir, data.name).state is SampleState.INCOMPLETE


def test_failed_lock(hs_dir: Path) -> None:
    lock = WriterLock.create(str(hs_dir / "failed.safetensors"))
    lock.mark_failed("CUDA out of memory")
    lock.release()
    health = check_sample(hs_dir, "failed.safetensors")  # young, still failed at once
    assert health.state is SampleState.FAILED
    assert "CUDA out of memory" in health.reason
    assert health.lock_status is not None and health.lock_status.failed
    assert health.as_dict()["lock_status"]["state"] == "failed"


def test_stale_locks(hs_dir: Path) -> None:
    ours = WriterLock.create(str(hs_dir / "stale.safetensors"))
    ours.release()
    (hs_dir / "stale_vllm.safetensors.lock").write_bytes(b"")  # vLLM's empty lock
    now = time.time()
    for name in ("stale.safetensors", "stale_vllm.safetensors"):
        young = check_sample(hs_dir, name, now=now)
        assert young.state is SampleState.PENDING, "a fresh lock may be about to be locked"
        age(hs_dir / (name + ".lock"))
        old = check_sample(hs_dir, name)
        assert old.state is SampleState.STALE
        assert "data file never appeared" in old.reason
        assert old.size is None and old.header is None


def test_missing_and_invalid_names(hs_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        check_sample(hs_dir, "nothing.safetensors")
    with pytest.raises(ValueError, match="not a sample name"):
        check_sample(hs_dir, "notes.txt")
    with pytest.raises(ValueError, match="not a temporary file name"):
        check_temp(hs_dir, "hs_0.safetensors")
    with pytest.raises(FileNotFoundError):
        list(scan_health(hs_dir / "absent"))


# -- temporary files ----------------------------------------------------------------


def test_temp_files(hs_dir: Path, holder: LockHolder) -> None:
    orphan = hs_dir / "hs_1.safetensors.tmp.4242.deadbeef"
    young = hs_dir / "hs_2.safetensors.tmp.4242.cafe"
    owned = hs_dir / "hs_3.safetensors.tmp.4242.beef"
    lock_tmp_held = hs_dir / "hs_4.safetensors.lock.tmp.4242.aaaa"
    lock_tmp_free = hs_dir / "hs_5.safetensors.lock.tmp.4242.bbbb"
    for p in (orphan, young, owned, lock_tmp_free):
        p.write_bytes(b"x" * 10)
    holder.lock(hs_dir / "hs_3.safetensors")
    holder.flock(lock_tmp_held)
    try:
        for p in (orphan, owned, lock_tmp_held, lock_tmp_free):
            age(p)
        states = {p.name: check_temp(hs_dir, p.name) for p in (orphan, young, owned)}
        states[lock_tmp_held.name] = check_temp(hs_dir, lock_tmp_held.name)
        states[lock_tmp_free.name] = check_temp(hs_dir, lock_tmp_free.name)
    finally:
        holder.release(hs_dir / "hs_3.safetensors")
        holder.release(lock_tmp_held)
    assert {k: v.state for k, v in states.items()} == {
        orphan.name: SampleState.ORPHAN_TEMP,
        young.name: SampleState.PENDING,
        owned.name: SampleState.PENDING,
        lock_tmp_held.name: SampleState.PENDING,
        lock_tmp_free.name: SampleState.ORPHAN_TEMP,
    }
    assert all(v.is_temp for v in states.values())
    assert states[orphan.name].problem and states[orphan.name].size == 10
    assert states[orphan.name].as_dict()["kind"] == "temp"
    assert "hs_3.safetensors.lock is held" in states[owned.name].reason
    assert temp_owner_lock(str(orphan)) == str(hs_dir / "hs_1.safetensors.lock")
    assert temp_owner_lock(str(lock_tmp_free)) == str(lock_tmp_free)
    assert temp_owner_lock("notes.txt.tmp.1.2") is None
    assert check_temp(hs_dir, young.name, grace=0).state is SampleState.ORPHAN_TEMP


# -- whole directory ----------------------------------------------------------------


def test_scan_health_whole_directory(hs_dir: Path, holder: LockHolder) -> None:
    write_samples(hs_dir, 3)
    write_vllm_style(hs_dir / "vllm_0.safetensors", 0)
    shutil.copy(hs_dir / "hs_0.safetensors", hs_dir / "trunc.safetensors")
    with open(hs_dir / "trunc.safetensors", "r+b") as f:
        f.truncate(500)
    age(hs_dir / "trunc.safetensors")
    (hs_dir / "junk.safetensors").write_bytes(os.urandom(64))
    lock = WriterLock.create(str(hs_dir / "failed.safetensors"))
    lock.mark_failed("boom")
    lock.release()
    (hs_dir / "stale.safetensors.lock").write_bytes(b"")
    age(hs_dir / "stale.safetensors.lock")
    (hs_dir / "hs_7.safetensors.tmp.1.abc").write_bytes(b"x")
    age(hs_dir / "hs_7.safetensors.tmp.1.abc")
    (hs_dir / "notes.txt").write_text("not a sample")
    (hs_dir / ".quarantine").mkdir()
    (hs_dir / ".quarantine" / "old.safetensors").write_bytes(b"")
    holder.lock(hs_dir / "held.safetensors")
    calls: list[tuple[int, int]] = []
    try:
        results = list(scan_health(hs_dir, lambda d, t: calls.append((d, t))))
    finally:
        holder.release(hs_dir / "held.safetensors")

    assert {r.name: r.state.value for r in results} == {
        "failed.safetensors": "failed",
        "held.safetensors": "pending",
        "hs_0.safetensors": "ready",
        "hs_1.safetensors": "ready",
        "hs_2.safetensors": "ready",
        "junk.safetensors": "corrupt",
        "stale.safetensors": "stale",
        "trunc.safetensors": "incomplete",
        "vllm_0.safetensors": "ready",
        "hs_7.safetensors.tmp.1.abc": "orphan_temp",
    }
    # Samples first in natural order, then temporary files.
    assert [r.name for r in results][:3] == [
        "failed.safetensors",
        "held.safetensors",
        "hs_0.safetensors",
    ]
    assert results[-1].is_temp
    assert calls == [(i, 10) for i in range(1, 11)]
    assert count_states(results) == {
        "ready": 4,
        "pending": 1,
        "failed": 1,
        "stale": 1,
        "incomplete": 1,
        "corrupt": 1,
        "orphan_temp": 1,
    }
    assert {r.state for r in results if r.problem} == PROBLEM_STATES - {SampleState.EMPTY}
    samples, temps = list_entries(hs_dir)
    assert len(samples) == 9 and temps == ["hs_7.safetensors.tmp.1.abc"]
    assert [r.name for r in scan_health(hs_dir, include_temps=False)] == samples
