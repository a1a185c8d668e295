"""The reports of the ``hidden-state`` commands say what they mean.

CRC coverage (``verify --checksums``, ``--require-checksums``), header/data
contradictions (``inspect --verify``), byte counts labelled (file bytes vs tensor bytes),
``clean``'s file sizes, the lock status shown for a published sample, ``verify``'s
summary after ``clean``, and ``--grace`` on every command that classifies samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hidden_state_reader.apps.cli.main import build_parser
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample

from samples import make_tensors, write_samples

CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]
PAST = time.time() - 3600


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def run_json(*args: object) -> tuple[int, Any]:
    proc = run(*args, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def age(path: Path) -> None:
    os.utime(path, (PAST, PAST))


def test_verify_checksums_says_how_many_files_carry_no_crc(hs_dir: Path) -> None:
    token_ids, hidden = make_tensors(1)
    for i in range(2):
        write_sample(hs_dir / f"crc_{i}.safetensors", token_ids, hidden, checksum=True)
    for i in range(3):
        write_sample(hs_dir / f"plain_{i}.safetensors", token_ids, hidden, checksum=False)

    proc = run("verify", hs_dir, "--checksums")
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("5 ready; 2 CRC32s verified")
    assert lines[1] == "3 of 5 files have no CRC32: corruption there cannot be detected"
    assert lines[-1] == "no problems found"
    rc, report = run_json("verify", hs_dir, "--checksums")
    assert rc == 0 and report["ok"] is True
    assert report["checksums"] == {
        "checked": 5,
        "verified": 2,
        "missing": 3,
        "missing_files": [f"plain_{i}.safetensors" for i in range(3)],
    }

    # --require-checksums: a file without a CRC32 is a problem.
    proc = run("verify", hs_dir, "--require-checksums")
    assert proc.returncode == 1
    assert "3 of 5 files have no CRC32: corruption there cannot be detected " \
        "(--require-checksums: a problem)" in proc.stdout  # fmt: skip
    rc, report = run_json("verify", hs_dir, "--require-checksums")
    assert rc == 1 and report["ok"] is False and report["checksums"]["missing"] == 3
    for i in range(3):
        os.unlink(hs_dir / f"plain_{i}.safetensors")
    proc = run("verify", hs_dir, "--require-checksums")
    assert proc.returncode == 0 and "no CRC32" not in proc.stdout, proc.stdout


def test_inspect_verify_flags_data_the_header_contradicts(hs_dir: Path) -> None:
    path = hs_dir / "hs_0.safetensors"
    write_sample(path, *make_tensors(0), checksum=False)  # records nonfinite=0
    header = read_header(path)
    assert header.metadata["nonfinite"] == "0"
    with open(path, "r+b") as f:  # four bf16 NaNs where the header says there are none
        f.seek(header.data_start + header.hidden.begin)
        f.write(b"\xc0\x7f" * 4)

    proc = run("inspect", path, "--verify")
    assert proc.returncode == 1, proc.stdout
    assert (
        "verify:      PROBLEM: the header records no NaN/inf (nonfinite=0) but the data has "
        "4 non-finite values (no CRC32 recorded; 4 non-finite values)"
    ) in proc.stdout
    rc, info = run_json("inspect", path, "--verify")
    assert rc == 1 and info["verify"]["ok"] is False
    assert info["verify"]["nonfinite_values"] == 4
    assert len(info["verify"]["contradictions"]) == 1

    good = hs_dir / "hs_1.safetensors"
    write_sample(good, *make_tensors(1), checksum=False)
    proc = run("inspect", good, "--verify")
    assert proc.returncode == 0
    assert "verify:      OK (no CRC32 recorded); 0 non-finite values" in proc.stdout


def test_byte_counts_are_labelled_file_bytes_or_tensor_bytes(hs_dir: Path) -> None:
    (path,) = write_samples(hs_dir, 1)
    file_bytes = path.stat().st_size
    header = read_header(path)
    tensor_bytes = sum(t.nbytes for t in header.tensors.values())

    proc = run("ls", hs_dir)
    assert "FILE BYTES" in proc.stdout.splitlines()[0]
    _, listing = run_json("ls", hs_dir)
    assert listing[0]["file_bytes"] == file_bytes and "size" not in listing[0]
    _, stats = run_json("stats", hs_dir)
    assert stats["file_bytes"] == file_bytes and "total_bytes" not in stats
    assert "file bytes:" in run("stats", hs_dir).stdout
    _, info = run_json("inspect", path)
    assert info["file_bytes"] == file_bytes
    assert sum(t["tensor_bytes"] for t in info["tensors"].values()) == tensor_bytes
    assert "TENSOR BYTES" in run("inspect", path).stdout

    proc = run("tail", hs_dir, "--max-samples", 1, "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["tensor_bytes"] == tensor_bytes and "bytes" not in record
    assert "tensor bytes (reached --max-samples 1)" in proc.stderr
    assert "tensor bytes" in run("tail", hs_dir, "--max-samples", 1).stdout


def test_clean_reports_the_file_bytes_of_what_it_keeps_and_takes_grace(hs_dir: Path) -> None:
    write_samples(hs_dir, 1)
    garbage = hs_dir / "garbage.safetensors"
    garbage.write_bytes(bytes(range(256)) * 78 + bytes(32))  # 20,000 bytes
    stale = hs_dir / "stale.safetensors"
    WriterLock.create(str(stale)).release()
    for entry in os.listdir(hs_dir):
        age(hs_dir / entry)
    lock_bytes = (hs_dir / "stale.safetensors.lock").stat().st_size

    rc, plan = run_json("clean", hs_dir, "--grace", 0, "--dry-run")
    assert rc == 0
    files = {os.path.basename(f["path"]): f for f in plan["files"]}
    assert files["garbage.safetensors"]["outcome"] == "kept"
    assert files["garbage.safetensors"]["file_bytes"] == 20_000
    assert files["stale.safetensors.lock"]["outcome"] == "would remove"
    assert files["stale.safetensors.lock"]["file_bytes"] == lock_bytes


def test_verify_summary_before_and_after_clean(hs_dir: Path) -> None:
    write_samples(hs_dir, 2)
    (hs_dir / "garbage.safetensors").write_bytes(bytes(range(256)))
    WriterLock.create(str(hs_dir / "stale.safetensors")).release()
    for entry in os.listdir(hs_dir):
        age(hs_dir / entry)
    proc = run("verify", hs_dir)
    assert proc.stdout.splitlines()[-1] == (
        f"2 problems found (`hidden-state clean {hs_dir}` removes the 1 stale/failed lock; "
        "the 1 data file it never removes)"
    )
    assert run("clean", hs_dir).returncode == 0
    proc = run("verify", hs_dir)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == (
        "1 problem found (`hidden-state clean` never removes data files: delete it by hand)"
    )


def test_ls_json_shows_a_lock_status_only_while_it_is_current(hs_dir: Path) -> None:
    write_samples(hs_dir, 1)
    failed = WriterLock.create(str(hs_dir / "failed.safetensors"), request_id="req-f")
    failed.mark_failed("out of disk space")
    failed.release()
    held = WriterLock.create(str(hs_dir / "held.safetensors"), request_id="req-h")
    try:
        _, listing = run_json("ls", hs_dir)
    finally:
        held.release()
    entries = {e["name"]: e for e in listing}
    ready = entries["hs_0.safetensors"]
    assert ready["state"] == "ready" and "lock_status" not in ready  # not "writing"
    assert ready["writer"]["pid"] == os.getpid()  # who wrote it stays visible
    assert entries["held.safetensors"]["lock_status"]["state"] == "writing"
    assert entries["held.safetensors"]["lock_status"]["request_id"] == "req-h"
    assert entries["failed.safetensors"]["lock_status"]["state"] == "failed"
    _, info = run_json("inspect", hs_dir / "hs_0.safetensors")
    assert info["lock_status"] is None


COMMAND_LINES = {
    "ls": ["ls", "DIR"],
    "stats": ["stats", "DIR"],
    "verify": ["verify", "DIR"],
    "clean": ["clean", "DIR"],
    "inspect": ["inspect", "FILE"],
    "tail": ["tail", "DIR"],
    "export": ["export", "--format", "speculators", "SRC", "DST"],
}


@pytest.mark.parametrize("command", sorted(COMMAND_LINES))
def test_every_command_that_classifies_takes_grace(command: str) -> None:
    args = build_parser(plugins=False).parse_args([*COMMAND_LINES[command], "--grace", "0"])
    assert (args.older_than if command == "clean" else args.grace) == 0.0
    assert "--grace" in run(command, "--help").stdout
