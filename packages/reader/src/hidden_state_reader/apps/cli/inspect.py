"""``hidden-state inspect``: everything about one sample file, and what is wrong with it.

The sample's state comes from ``health.check_sample`` (the rule every count uses). A
file that is not a valid sample is still shown as far as it can be read (its size, its
state and why, the header as written); a problem exits with status 1, never 2 (bad usage
is for arguments). ``--verify`` loads the data, checks the CRC32 and compares the data
with what the header records (``contradictions``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import time
from typing import TYPE_CHECKING, Any

from hidden_state_reader.apps.cli.common import (
    EXIT_PROBLEMS,
    add_grace_argument,
    print_json,
    require_sample_file,
)
from hidden_state_reader.apps.cli.table import format_count, format_pairs, format_table
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_OK,
    CliError,
    add_command,
    format_bytes,
    read_token_ids,
)
from hidden_state_reader.errors import SampleError
from hidden_state_reader.format.header import MAX_HEADER_BYTES, Meta, SampleHeader
from hidden_state_reader.format.lock_status import LockState
from hidden_state_reader.format.names import DATA_SUFFIX, LOCK_SUFFIX, lock_path
from hidden_state_reader.sample.health import SampleHealth, check_sample
from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:
    import torch


def register(subparsers: Any) -> None:
    """Add ``inspect``."""
    p = add_command(
        subparsers,
        "inspect",
        summary="show one sample file: header, metadata, shapes, state, checksum",
        description="Show everything about one sample file: its tensors (dtype, shape, "
        "offsets, tensor bytes),\nmetadata (layer ids, model, request id, ...), the "
        "non-finite flag, the lock, the sample state\nand the first token ids. A file "
        "that is not a valid sample (truncated, corrupt) is shown as far\nas it can be "
        "read: file bytes, state and why, the header as written. A sample without a "
        "data\nfile (failed, pending, stale) is shown from its lock: state, reason, writer "
        "pid, host and\nrequest id. With --verify the tensor data is read, the writer's "
        "CRC32 checked and the data\ncompared with the header (a non-finite flag of 0 over "
        "NaN values is a contradiction).\n\n"
        "exit status: 0 ok (ready or pending), 1 a problem (a state other than ready or "
        "pending, a\nCRC32 mismatch, a header the data contradicts), 2 bad usage (no such "
        "file, not a sample name)",
        examples="""
hidden-state inspect /data/hs/hs_0.safetensors
hidden-state inspect /data/hs/hs_0.safetensors --verify --tokens 32
hidden-state inspect /data/hs/hs_0.safetensors --verify --json | jq .verify
""",
        handler=run_inspect,
    )
    p.add_argument("file", metavar="FILE", help="a NAME.safetensors sample file")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read the tensor data, check the CRC32, count non-finite values and compare "
        "the data with the header's records",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=16,
        metavar="N",
        help="how many leading token ids to show (0: none)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: path, state, reason, file_bytes, lock, tensors (tensor_bytes "
        "each), metadata, verify",
    )
    add_grace_argument(p, GRACE)


def run_inspect(args: argparse.Namespace) -> int:
    """``hidden-state inspect``."""
    given = args.file
    if given.endswith(DATA_SUFFIX + LOCK_SUFFIX):
        given = given[: -len(LOCK_SUFFIX)]
    if args.tokens < 0:
        raise CliError(f"--tokens must be 0 or more, got {args.tokens}")
    if not os.path.lexists(given) and os.path.lexists(lock_path(given)):
        return _without_data(given, args.json, args.grace)
    path = require_sample_file(given)
    try:
        root, name = os.path.dirname(path) or ".", os.path.basename(path)
        health = check_sample(root, name, grace=args.grace)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    rc = EXIT_PROBLEMS if health.problem else EXIT_OK
    if health.header is None:
        _unreadable(path, health, args.json)
        return rc
    info = _info(path, health.header, health, args.tokens)
    if args.verify:
        rc = max(rc, _verify_data(path, health.header, info))
    if args.json:
        print_json(info)
    else:
        _print_info(info, verified=args.verify, shown=args.tokens)
    return rc


def _lock_pairs(health: SampleHealth) -> tuple[str, dict[str, Any] | None]:
    status = health.current_lock_status
    lock = health.lock.value
    if health.lock is LockState.HELD:
        lock += " (a writer is still at work)"
    elif status is not None and status.failed:
        lock += " (status: failed)"
    return lock, None if status is None else {"state": status.state, **status.detail}


def _without_data(path: str, as_json: bool, grace: float) -> int:
    """A sample whose data file is not there (yet): its state, from its lock."""
    root, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        health = check_sample(root, name, grace=grace)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    status = health.lock_status
    info: dict[str, Any] = {
        "path": os.path.abspath(health.path),
        "state": health.state.value,
        "reason": health.reason,
        "lock": health.lock.value,
        "lock_status": None
        if status is None or status.state is None
        else {"state": status.state, **status.detail},
    }
    if as_json:
        print_json(info)
    else:
        pairs: list[tuple[str, object]] = [
            ("file", f"{info['path']} (no data file)"),
            ("state", f"{health.state.value}: {health.reason}"),
            ("lock", health.lock.value),
        ]
        if info["lock_status"] is not None:
            pairs += [(f"lock {k}", v) for k, v in info["lock_status"].items()]
        print(format_pairs(pairs))
    return EXIT_PROBLEMS if health.problem else EXIT_OK


def _unreadable(path: str, health: SampleHealth, as_json: bool) -> None:
    """A file without a valid header: what can be read of it."""
    raw = _raw_header(path)
    lock, lock_status = _lock_pairs(health)
    info: dict[str, Any] = {
        "path": os.path.abspath(path),
        "state": health.state.value,
        "reason": health.reason,
        "file_bytes": health.size,
        "lock": health.lock.value,
        "lock_status": lock_status,
        "header_as_written": raw,
    }
    if as_json:
        print_json(info)
        return
    pairs: list[tuple[str, object]] = [
        ("file", info["path"]),
        ("file bytes", "-" if health.size is None else f"{health.size:,}"),
        ("state", health.state.value + (f": {health.reason}" if health.reason else "")),
        ("lock", lock),
    ]
    print(format_pairs(pairs))
    if raw is None:
        print("header: unreadable")
        return
    print("header as written (not a valid sample):")
    rows = [
        [name, str(t.get("dtype")), str(t.get("shape")), str(t.get("data_offsets"))]
        for name, t in raw["tensors"].items()
    ]
    print(format_table(["NAME", "DTYPE", "SHAPE", "OFFSETS"], rows, indent="  "))
    if raw["metadata"]:
        print("metadata:")
        print(format_pairs([(k, _meta_value(k, str(v))) for k, v in raw["metadata"].items()],
                           indent="  "))  # fmt: skip


def _raw_header(path: str) -> dict[str, Any] | None:
    """The JSON header as written, if it can be read at all (no validation)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return None
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                return None
            doc = json.loads(f.read(length))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    meta = doc.pop("__metadata__", None)
    tensors = {str(k): v for k, v in doc.items() if isinstance(v, dict)}
    return {"tensors": tensors, "metadata": meta if isinstance(meta, dict) else {}}


def _info(path: str, header: SampleHeader, health: SampleHealth, tokens: int) -> dict[str, Any]:
    """What ``inspect`` shows of a sample with a readable header (its ``--json``)."""
    meta = dict(header.metadata)
    _, lock_status = _lock_pairs(health)
    return {
        "path": os.path.abspath(path),
        "state": health.state.value,
        "reason": health.reason,
        "file_bytes": header.file_size,
        "header_bytes": header.data_start,
        "lock": health.lock.value,
        "lock_status": None if lock_status is None else lock_status["state"],
        "tensors": {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.begin, t.end],
                "tensor_bytes": t.nbytes,
            }
            for name, t in header.tensors.items()
        },
        "tokens": header.num_tokens,
        "layers": header.num_layers,
        "hidden": header.hidden_size,
        "dtype": header.hidden.dtype,
        "layer_ids": header.layer_ids,
        "format_version": meta.get(Meta.FORMAT),
        "nonfinite": {"0": False, "1": True}.get(meta.get(Meta.NONFINITE, "")),
        "crc32": meta.get(Meta.CRC32),
        "metadata": meta,
        "first_token_ids": read_token_ids(path, header, tokens),
        "loss_mask_trained": _mask_trained(path, header),
    }


def _mask_trained(path: str, header: SampleHeader) -> int | None:
    """Tokens the optional ``loss_mask`` marks (non-zero bytes); None without a mask."""
    info = header.loss_mask
    if info is None:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, info.nbytes, header.data_start + info.begin)
    finally:
        os.close(fd)
    return len(raw) - raw.count(0)


def contradictions(header: SampleHeader, hidden: torch.Tensor) -> list[str]:
    """What the header records that the data (or its shape) contradicts, in words.

    Args:
        header: The file's header.
        hidden: Its ``hidden_states`` as loaded (dequantized for fp8 files).

    Returns:
        One sentence per contradiction; empty when the data agrees with every record.
    """
    import torch

    out = []
    meta = header.metadata
    nonfinite = int((~torch.isfinite(hidden)).sum()) if hidden.numel() else 0
    flag = meta.get(Meta.NONFINITE)
    if flag == "0" and nonfinite:
        out.append(
            f"the header records no NaN/inf ({Meta.NONFINITE}=0) but the data has "
            f"{nonfinite:,} non-finite values"
        )
    elif flag == "1" and not nonfinite:
        out.append(f"the header records NaN/inf ({Meta.NONFINITE}=1) but the data has none")
    prompt = meta.get(Meta.NUM_PROMPT_TOKENS)
    if prompt is not None and not (prompt.isdigit() and int(prompt) <= header.num_tokens):
        out.append(
            f"metadata {Meta.NUM_PROMPT_TOKENS}={prompt!r} does not fit the file's "
            f"{header.num_tokens:,} tokens"
        )
    return out


def _verify_data(path: str, header: SampleHeader, info: dict[str, Any]) -> int:
    """Load the data, check the CRC32, count non-finite values, compare with the header."""
    import torch  # here, not at the top: `hidden-state --help` must not pay for torch

    from hidden_state_reader.options import LoadOptions
    from hidden_state_reader.sample.load import load_sample

    try:
        sample = load_sample(path, LoadOptions(verify_checksum=True))
    except SampleError as exc:
        info["verify"] = {"ok": False, "error": exc.reason}
        return EXIT_PROBLEMS
    hidden = sample.hidden_states
    found = contradictions(header, hidden)
    info["verify"] = {
        "ok": not found,
        "crc32_checked": info["crc32"] is not None,
        "nonfinite_values": int((~torch.isfinite(hidden)).sum()) if hidden.numel() else 0,
    }
    if found:
        info["verify"]["contradictions"] = found
        return EXIT_PROBLEMS
    return EXIT_OK


def _print_info(info: dict[str, Any], *, verified: bool, shown: int) -> None:
    lock = info["lock"]
    if info["lock"] == LockState.HELD.value:
        lock += " (a writer is still at work)"
    elif info["lock_status"] == "failed":
        lock += " (status: failed)"
    nonfinite = {None: "not recorded", False: "no", True: "YES (NaN or inf present)"}[
        info["nonfinite"]
    ]
    layer_ids = info["layer_ids"]
    size = info["file_bytes"]
    mask = info["loss_mask_trained"]
    pairs: list[tuple[str, object]] = [
        ("file", info["path"]),
        ("file bytes", f"{format_bytes(size)} ({size:,} bytes, header {info['header_bytes']})"),
        ("state", info["state"] + (f": {info['reason']}" if info["reason"] else "")),
        ("lock", lock),
        ("format", info["format_version"] or "not recorded"),
        ("tokens", format_count(info["tokens"])),
        ("layers", info["layers"]),
        ("layer ids", layer_ids if layer_ids is not None else "not recorded"),
        ("hidden size", info["hidden"]),
        ("dtype", info["dtype"]),
        (
            "loss mask",
            "none"
            if mask is None
            else f"{format_count(mask)} of {format_count(info['tokens'])} tokens trained",
        ),
        ("nonfinite", nonfinite),
        ("crc32", info["crc32"] or "not recorded"),
    ]
    if verified:
        pairs.append(("verify", _verdict(info["verify"])))
    print(format_pairs(pairs))
    _print_tensors_and_metadata(info)
    if shown:
        ids = info["first_token_ids"]
        more = " ..." if info["tokens"] > len(ids) else ""
        print(f"token ids (first {len(ids)} of {info['tokens']:,}): {ids}{more}")


def _verdict(v: dict[str, Any]) -> str:
    if "error" in v:
        return f"FAILED: {v['error']}"
    crc = "CRC32 matches" if v["crc32_checked"] else "no CRC32 recorded"
    nonfinite = f"{v['nonfinite_values']:,} non-finite values"
    if v.get("contradictions"):
        return f"PROBLEM: {'; '.join(v['contradictions'])} ({crc}; {nonfinite})"
    verdict = "OK, CRC32 matches" if v["crc32_checked"] else "OK (no CRC32 recorded)"
    return f"{verdict}; {nonfinite}"


def _print_tensors_and_metadata(info: dict[str, Any]) -> None:
    print("tensors:")
    rows = [
        [
            name,
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            f"{t['data_offsets'][0]}..{t['data_offsets'][1]}",
            format_bytes(t["tensor_bytes"]),
        ]
        for name, t in info["tensors"].items()
    ]
    print(format_table(["NAME", "DTYPE", "SHAPE", "OFFSETS", "TENSOR BYTES"], rows, indent="  "))
    meta = info["metadata"]
    if meta:
        print("metadata:")
        rendered = [(k, _meta_value(k, v)) for k, v in sorted(meta.items())]
        print(format_pairs(rendered, indent="  "))
    else:
        print("metadata: none")


def _meta_value(key: str, value: str) -> str:
    if key == Meta.CREATED:
        try:
            stamp = float(value)
        except ValueError:
            return value
        if math.isfinite(stamp):
            return f"{value} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stamp))})"
    return value if len(value) <= 200 else value[:197] + "..."


__all__ = ["contradictions", "register", "run_inspect"]
