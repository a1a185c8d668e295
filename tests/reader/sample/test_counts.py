"""Every count of a mixed directory agrees with the reader, file by file.

One directory holds good samples and every reject case there is: the byte-level cases of
``bad_files`` (truncated, corrupt, empty, ...), failed and stale locks, a ``loss_mask``
holding a 7, fp8 files whose scales or ``model_dtype`` are wrong, a changed byte under a
CRC32, non-regular files. ``hidden-state ls``, ``stats`` and ``verify`` (subprocesses,
``--json``), ``len(HiddenStateDataset)``, ``len(HiddenStateLoader)`` (and the batches it
yields) and the samples ``HiddenStateReader`` yields must say the same about each file;
then again with checksums on (``verify --checksums``, ``verify_checksum=True``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, HiddenStateReader
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import encode_header

from bad_files import CASES
from samples import make_tensors, write_samples

CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]
PAST = time.time() - 3600
T, L, H = 6, 2, 8

# The reject cases the loader used to find alone (listings said "ready"), and cases whose
# verdict this test pins down; every other file's verdict is only required to agree.
EXPECTED = {
    "mask_7.safetensors": "corrupt",  # loss_mask[3] == 7: the loader refuses it
    "fp8_model_dtype_i64.safetensors": "corrupt",  # nothing to dequantize to
    "fp8_scales_wrong_shape.safetensors": "corrupt",
    "fp8_without_scales.safetensors": "corrupt",
    "fp8_ok.safetensors": "ready",
    "mapped_misaligned.safetensors": "ready",  # >= 1 MiB, header not 8-aligned: loads now
    "crc_changed_byte.safetensors": "ready",  # corrupt when checksums are checked
    "masked_ok.safetensors": "ready",
    "failed.safetensors": "failed",
    "stale.safetensors": "stale",
    "zero-tokens.safetensors": "empty",
    "truncated-in-data.safetensors": "incomplete",
    "fifo.safetensors": "corrupt",
    "directory.safetensors": "corrupt",
}
WITH_CHECKSUMS = {"crc_changed_byte.safetensors": "corrupt"}


def _patch(path: Path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def _raw(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], **meta: str) -> None:
    layout = encode_header(tensors, {"format_version": "1", **meta})
    path.write_bytes(layout.header + bytes(layout.file_size - layout.data_start))


def _fp8(**extra: tuple[torch.dtype, tuple[int, ...]]) -> dict[str, Any]:
    return {
        "token_ids": (torch.int64, (T,)),
        "hidden_states": (torch.float8_e4m3fn, (T, L, H)),
        **extra,
    }


def build_mixed(root: Path) -> None:
    """Good samples and one file of every reject case, all older than the grace period."""
    write_samples(root, 3, prefix="good_", tokens=T, layers=L, hidden=H)
    token_ids, hidden = make_tensors(7, T, L, H)
    write_sample(root / "masked_ok.safetensors", token_ids, hidden, loss_mask=[0, 0, 1, 1, 1, 1])
    write_sample(root / "mask_7.safetensors", token_ids, hidden, loss_mask=[0] * 3 + [1] * 3,
                 checksum=False)  # fmt: skip
    header = read_header(root / "mask_7.safetensors")
    assert header.loss_mask is not None
    _patch(root / "mask_7.safetensors", header.data_start + header.loss_mask.begin + 3, b"\x07")
    write_sample(root / "fp8_ok.safetensors", token_ids, hidden, storage="fp8_e4m3")
    _raw(root / "fp8_model_dtype_i64.safetensors",
         _fp8(hidden_states_scales=(torch.float32, (T, L, 1))), model_dtype="I64")  # fmt: skip
    _raw(root / "fp8_scales_wrong_shape.safetensors",
         _fp8(hidden_states_scales=(torch.float32, (T, L, 2))))  # fmt: skip
    _raw(root / "fp8_without_scales.safetensors", _fp8())
    write_sample(root / "crc_changed_byte.safetensors", token_ids, hidden, checksum=True)
    header = read_header(root / "crc_changed_byte.safetensors")
    _patch(root / "crc_changed_byte.safetensors", header.data_start + header.hidden.begin, b"\x55")
    _mapped_misaligned(root / "mapped_misaligned.safetensors")
    for case, (make, _) in CASES.items():
        (root / f"{case}.safetensors").write_bytes(make())
    failed = WriterLock.create(str(root / "failed.safetensors"), request_id="req-f")
    failed.mark_failed("out of disk space")
    failed.release()
    WriterLock.create(str(root / "stale.safetensors")).release()
    os.mkfifo(root / "fifo.safetensors")
    (root / "directory.safetensors").mkdir()
    (root / "x.safetensors.tmp.4242.dead").write_bytes(b"half")  # a temp file: no sample
    for entry in os.listdir(root):
        os.utime(root / entry, (PAST, PAST), follow_symlinks=False)


def _mapped_misaligned(path: Path) -> None:
    """A file the loader maps (>= 1 MiB, ``format_version``) whose data is not 8-aligned."""
    tokens, hidden = 64, 4 * 2048
    doc = {
        "__metadata__": {"format_version": "1"},
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, 8 * tokens]},
        "hidden_states": {
            "dtype": "BF16",
            "shape": [tokens, 4, 2048],
            "data_offsets": [8 * tokens, 8 * tokens + 2 * tokens * hidden],
        },
    }
    body = json.dumps(doc).encode()
    body += b" " * ((-(8 + len(body)) % 8) + 3)
    size = 8 * tokens + 2 * tokens * hidden
    path.write_bytes(len(body).to_bytes(8, "little") + body + bytes(size))


def cli_json(*args: object) -> Any:
    proc = subprocess.run(
        [*CLI, *map(str, args), "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def counts(root: Path, *, checksums: bool) -> dict[str, dict[str, Any]]:
    """What each count says about each file: its state, or whether it is counted/yielded."""
    check = ["--checksums"] if checksums else []
    listing = cli_json("ls", root)
    stats = cli_json("stats", root)
    report = cli_json("verify", root, *check)
    options = {"verify_checksum": checksums}
    dataset = HiddenStateDataset(root, **options)
    loader = HiddenStateLoader(HiddenStateDataset(root, **options), batch_size=1)
    batches = [batch["paths"] for batch in loader]
    assert len(batches) == len(loader), "the loader yields as many batches as its len()"
    reader = HiddenStateReader(root, **options)
    yielded = {os.path.basename(s.path) for s in reader}

    ls_state = {r["name"]: r["state"] for r in listing}
    problems = {p["name"]: p["state"] for p in report["problems"]}
    verify_state = {name: problems.get(name, "ready") for name in ls_state}
    in_dataset = set(dataset.epoch_names(0))
    in_loader = {os.path.basename(p) for paths in batches for p in paths}
    # stats and the lengths are totals: they must be the totals of the per-file verdicts
    # (ls and stats read no tensor data; with checksums verify and the readers do).
    assert stats["count"] == sum(1 for s in ls_state.values() if s == "ready")
    assert stats["states"] == dict(Counter(ls_state.values()))
    assert report["states"] == dict(Counter(verify_state.values()))
    ready = sum(1 for s in verify_state.values() if s == "ready")
    assert ready == len(dataset) == len(loader) == len(yielded)
    rows: dict[str, dict[str, Any]] = {
        name: {
            "ls": state,
            "verify": verify_state[name],
            "dataset": name in in_dataset,
            "loader": name in in_loader,
            "reader": name in yielded,
        }
        for name, state in sorted(ls_state.items())
    }
    rows["_stats"] = {"count": stats["count"], "reader_stats": reader.stats.as_dict()}
    return rows


def _table(rows: dict[str, dict[str, Any]], title: str) -> str:
    lines = [title, f"{'file':<38} {'ls':<11} {'verify':<11} dataset loader reader"]
    for name, row in rows.items():
        if name.startswith("_"):
            continue
        lines.append(
            f"{name:<38} {row['ls']:<11} {row['verify']:<11} {row['dataset']!s:<7} "
            f"{row['loader']!s:<6} {row['reader']!s}"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
def test_every_count_agrees_on_every_file(hs_dir: Path, checksums: bool) -> None:
    build_mixed(hs_dir)
    rows = counts(hs_dir, checksums=checksums)
    print(_table(rows, f"checksums={checksums}"))
    summary = rows.pop("_stats")
    expected = EXPECTED | (WITH_CHECKSUMS if checksums else {})
    for name, row in rows.items():
        if not checksums:  # ls reads no data: it agrees with verify without --checksums
            assert row["ls"] == row["verify"], (name, row)
        usable = row["verify"] == "ready"
        assert row["dataset"] is usable and row["loader"] is usable, (name, row)
        assert row["reader"] is usable, (name, row)
        if name in expected:
            assert row["verify"] == expected[name], (name, row)
    assert set(expected) <= set(rows), set(expected) - set(rows)
    assert set(CASES) <= {n.removesuffix(".safetensors") for n in rows}
    # The reader counted every file it did not yield, under the state the listing gave.
    states = Counter(row["verify"] for row in rows.values())
    reader_stats = summary["reader_stats"]
    assert reader_stats["yielded"] == states["ready"]
    assert reader_stats["corrupt"] == states["corrupt"]
    assert reader_stats["incomplete"] == states["incomplete"]
    assert reader_stats["empty"] == states["empty"]
    assert (reader_stats["failed"], reader_stats["stale_locks"]) == (1, 1)
