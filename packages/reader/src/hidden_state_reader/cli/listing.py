"""``hidden-state ls``, ``stats`` and ``inspect``: look at a directory or one sample."""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections import Counter
from typing import Any

from hidden_state_reader.cli.common import (
    EXIT_PROBLEMS,
    Progress,
    add_grace_argument,
    add_progress_argument,
    print_json,
    require_dir,
    require_sample_file,
)
from hidden_state_reader.cli.table import format_count, format_pairs, format_table
from hidden_state_reader.cli.toolkit import (
    EXIT_OK,
    CliError,
    add_command,
    format_bytes,
    read_token_ids,
)
from hidden_state_reader.errors import SampleError
from hidden_state_reader.format.header import Meta, SampleHeader, read_header
from hidden_state_reader.format.listing import describe_empty
from hidden_state_reader.format.lockfile import LockState, LockStatus, probe, read_status
from hidden_state_reader.format.names import DATA_SUFFIX, LOCK_SUFFIX, lock_path
from hidden_state_reader.sample.health import (
    SampleHealth,
    check_sample,
    count_states,
    scan_health,
)
from hidden_state_reader.sample.states import GRACE

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add ``ls``, ``stats`` and ``inspect``."""
    p = add_command(
        subparsers,
        "ls",
        summary="list samples: shape, dtype, size and state",
        description="List every sample of a hidden-state directory, one row each: name, "
        "tokens, captured layers, hidden size, dtype, file size and state\n"
        "(ready, pending, failed, stale, incomplete, corrupt). Never waits for a "
        "writer: locks are only probed.",
        examples="""
hidden-state ls /data/hs
hidden-state ls /data/hs --all --bytes     # also temporary files; exact sizes
hidden-state ls /data/hs --json | jq '.[] | select(.state != "ready")'
""",
        handler=run_ls,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    p.add_argument("-a", "--all", action="store_true", help="also list temporary files")
    p.add_argument("--bytes", action="store_true", help="print sizes in bytes")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_grace_argument(p, GRACE)
    add_progress_argument(p)

    p = add_command(
        subparsers,
        "stats",
        summary="totals and distributions over a directory",
        description="Summarise a hidden-state directory: number of ready samples, total "
        "tokens and bytes,\ncaptured layers, hidden sizes, dtypes, min/mean/median/max "
        "tokens per sample,\nbytes per token, and how many samples are in each state. "
        "Reads headers only.\n\n"
        "exit status: 0 ok, 1 no sample ready or being written (nothing to train on), 2 bad "
        "usage",
        examples="""
hidden-state stats /data/hs
hidden-state stats /data/hs --json
""",
        handler=run_stats,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_grace_argument(p, GRACE)
    add_progress_argument(p)

    p = add_command(
        subparsers,
        "inspect",
        summary="show one sample file: header, metadata, shapes, checksum",
        description="Show everything about one sample file: its tensors (dtype, shape, "
        "offsets), metadata\n(layer ids, model, request id, ...), the non-finite flag, the "
        "lock state, the sample state and the first token ids. A sample without a data\n"
        "file (failed, pending, stale) is shown from its lock: state, reason, writer pid,\n"
        "host and request id (exit status 1 for failed or stale).\nWith --verify the "
        "tensor data is read and the "
        "writer's CRC32 checked (exit status 1 on mismatch).",
        examples="""
hidden-state inspect /data/hs/hs_0.safetensors
hidden-state inspect /data/hs/hs_0.safetensors --verify --tokens 32
""",
        handler=run_inspect,
    )
    p.add_argument("file", metavar="FILE", help="a NAME.safetensors sample file")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read the tensor data, check the CRC32 and count non-finite values",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=16,
        metavar="N",
        help="how many leading token ids to show (0: none)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


# -- ls ------------------------------------------------------------------------------


def _scan(args: argparse.Namespace, *, include_temps: bool) -> list[SampleHealth]:
    root = require_dir(args.directory)
    progress = Progress.for_args(args, f"scanning {root}")
    return list(scan_health(root, progress, grace=args.grace, include_temps=include_temps))


def run_ls(args: argparse.Namespace) -> int:
    """``hidden-state ls``."""
    results = _scan(args, include_temps=True)
    samples = [r for r in results if not r.is_temp]
    temps = [r for r in results if r.is_temp]
    shown = results if args.all else samples
    if args.json:
        print_json([r.as_dict() for r in shown])
        return EXIT_OK
    if not shown:
        print(f"no samples in {args.directory}")
        if temps:
            print(f"({len(temps)} temporary files; see hidden-state ls --all)")
        return EXIT_OK
    size = (lambda n: format_count(n)) if args.bytes else format_bytes
    rows = []
    for r in shown:
        h = r.header
        rows.append(
            [
                r.name,
                format_count(h.num_tokens) if h else "-",
                h.num_layers if h else "-",
                h.hidden_size if h else "-",
                h.hidden.dtype if h else "-",
                size(r.size),
                r.state.value,
            ]
        )
    print(
        format_table(
            ["NAME", "TOKENS", "LAYERS", "HIDDEN", "DTYPE", "SIZE", "STATE"], rows, align="lrrrlrl"
        )
    )
    print(_summary_line(samples, temps))
    return EXIT_OK


def _summary_line(samples: list[SampleHealth], temps: list[SampleHealth]) -> str:
    states = ", ".join(f"{n} {s}" for s, n in count_states(samples).items())
    line = f"{len(samples)} sample{'s' if len(samples) != 1 else ''}"
    if states:
        line += f": {states}"
    if temps:
        temp_states = ", ".join(f"{n} {s}" for s, n in count_states(temps).items())
        line += f"; {len(temps)} temporary file{'s' if len(temps) != 1 else ''} ({temp_states})"
    return line


# -- stats ---------------------------------------------------------------------------


def directory_stats(results: list[SampleHealth]) -> dict[str, Any]:
    """Aggregate health results into the figures ``hidden-state stats`` prints.

    Sizes and token counts cover ready samples only; ``states`` covers every sample.

    Args:
        results: ``scan_health`` output (temporary files are counted separately).

    Returns:
        A JSON-friendly dict.
    """
    samples = [r for r in results if not r.is_temp]
    ready = [r for r in samples if r.ok and r.header is not None]
    tokens = sorted(r.header.num_tokens for r in ready if r.header is not None)
    total_tokens = sum(tokens)
    total_bytes = sum(r.size or 0 for r in ready)
    layers: Counter[int] = Counter()
    hidden: Counter[int] = Counter()
    dtypes: Counter[str] = Counter()
    for r in ready:
        assert r.header is not None
        layers[r.header.num_layers] += 1
        hidden[r.header.hidden_size] += 1
        dtypes[r.header.hidden.dtype] += 1
    return {
        "count": len(ready),
        "samples": len(samples),
        "total_tokens": total_tokens,
        "total_bytes": total_bytes,
        "layers": {str(k): v for k, v in sorted(layers.items())},
        "hidden": {str(k): v for k, v in sorted(hidden.items())},
        "dtypes": dict(dtypes.most_common()),
        "min_tokens": tokens[0] if tokens else None,
        "mean_tokens": round(total_tokens / len(tokens), 2) if tokens else None,
        "median_tokens": _median(tokens),
        "max_tokens": tokens[-1] if tokens else None,
        "bytes_per_token": round(total_bytes / total_tokens, 2) if total_tokens else None,
        "states": count_states(samples),
        "temp_files": count_states(r for r in results if r.is_temp),
    }


def _median(sorted_values: list[int]) -> float | None:
    n = len(sorted_values)
    if not n:
        return None
    mid = n // 2
    if n % 2:
        return float(sorted_values[mid])
    return (sorted_values[mid - 1] + sorted_values[mid]) / 2


def _distribution(counter: dict[str, int]) -> str:
    if not counter:
        return "-"
    if len(counter) == 1:
        return next(iter(counter))
    return ", ".join(f"{k} ({v})" for k, v in counter.items())


def run_stats(args: argparse.Namespace) -> int:
    """``hidden-state stats``."""
    results = _scan(args, include_temps=True)
    stats = directory_stats(results)
    # A script must notice a directory with nothing to train on, now or soon.
    usable = sum(1 for r in results if not r.is_temp and r.state.usable)
    rc = EXIT_OK if usable else EXIT_PROBLEMS
    if not results:
        log.warning("%s", describe_empty(args.directory))
    if args.json:
        print_json({"directory": os.path.abspath(args.directory), **stats})
        return rc
    states = ", ".join(f"{n} {s}" for s, n in stats["states"].items()) or "none"
    temps = ", ".join(f"{n} {s}" for s, n in stats["temp_files"].items()) or "none"
    bpt = stats["bytes_per_token"]
    pairs: list[tuple[str, object]] = [
        ("directory", os.path.abspath(args.directory)),
        ("ready samples", format_count(stats["count"])),
        ("total tokens", format_count(stats["total_tokens"])),
        ("total bytes", f"{format_bytes(stats['total_bytes'])} ({stats['total_bytes']:,} bytes)"),
        ("layers", _distribution(stats["layers"])),
        ("hidden size", _distribution(stats["hidden"])),
        ("dtypes", _distribution(stats["dtypes"])),
        (
            "tokens/sample",
            f"min {format_count(stats['min_tokens'])}  mean {format_count(stats['mean_tokens'])}"
            f"  median {format_count(stats['median_tokens'])}  max "
            f"{format_count(stats['max_tokens'])}",
        ),
        ("bytes/token", "-" if bpt is None else f"{bpt:,.1f}"),
        ("states", states),
        ("temporary files", temps),
    ]
    print(format_pairs(pairs))
    return rc


# -- inspect -------------------------------------------------------------------------


def _inspect_without_data(path: str, as_json: bool) -> int:
    """A sample whose data file is not there (yet): its state, from its lock."""
    root, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        health = check_sample(root, name)
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


def run_inspect(args: argparse.Namespace) -> int:
    """``hidden-state inspect``."""
    given = args.file
    if given.endswith(DATA_SUFFIX + LOCK_SUFFIX):
        given = given[: -len(LOCK_SUFFIX)]
    if not os.path.lexists(given) and os.path.lexists(lock_path(given)):
        return _inspect_without_data(given, args.json)
    path = require_sample_file(given)
    if args.tokens < 0:
        raise CliError(f"--tokens must be 0 or more, got {args.tokens}")
    lock_file = lock_path(path)
    lock = probe(lock_file)
    status = read_status(lock_file) if lock is not LockState.ABSENT else None
    header = _readable_header(path)
    try:
        layer_ids: list[int] | None = header.layer_ids
        layer_note = ""
    except SampleError as exc:
        layer_ids, layer_note = None, exc.reason
    info = _inspect_info(path, header, lock, status, layer_ids, args.tokens)
    rc = EXIT_OK
    if args.verify:
        rc = _verify_data(path, info)
    if args.json:
        print_json(info)
        return rc
    _print_inspect(info, layer_note, verified=args.verify, shown=args.tokens)
    return rc


def _readable_header(path: str) -> SampleHeader:
    """The file's header, or a ``CliError`` saying in which state the sample is."""
    try:
        return read_header(path)
    except SampleError as exc:
        try:
            health = check_sample(os.path.dirname(path) or ".", os.path.basename(path))
            why = f"{health.state.value}: {health.reason or exc.reason}"
        except OSError:
            why = exc.reason
        raise CliError(f"{path}: {why}") from None


def _inspect_info(
    path: str,
    header: SampleHeader,
    lock: LockState,
    status: LockStatus | None,
    layer_ids: list[int] | None,
    tokens: int,
) -> dict[str, Any]:
    """What ``inspect`` shows of a sample with a readable header (its ``--json``)."""
    meta = dict(header.metadata)
    recorded_nonfinite = {"0": False, "1": True}.get(meta.get(Meta.NONFINITE, ""))
    health = check_sample(os.path.dirname(path) or ".", os.path.basename(path))
    info: dict[str, Any] = {
        "path": os.path.abspath(path),
        "state": health.state.value,
        "reason": health.reason,
        "size": header.file_size,
        "header_bytes": header.data_start,
        "lock": lock.value,
        "lock_status": None if status is None or status.state is None else status.state,
        "tensors": {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.begin, t.end],
                "bytes": t.nbytes,
            }
            for name, t in header.tensors.items()
        },
        "tokens": header.num_tokens,
        "layers": header.num_layers,
        "hidden": header.hidden_size,
        "dtype": header.hidden.dtype,
        "layer_ids": layer_ids,
        "format_version": meta.get(Meta.FORMAT),
        "nonfinite": recorded_nonfinite,
        "crc32": meta.get(Meta.CRC32),
        "metadata": meta,
        "first_token_ids": read_token_ids(path, header, tokens),
        "loss_mask_trained": _mask_trained(path, header),
    }
    return info


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


def _verify_data(path: str, info: dict[str, Any]) -> int:
    """Load the data, check the CRC32 and count non-finite values; fill ``info``."""
    import torch  # here, not at the top: `hidden-state --help` must not pay for torch

    from hidden_state_reader.options import LoadOptions
    from hidden_state_reader.sample.load import load_sample

    try:
        sample = load_sample(path, LoadOptions(verify_checksum=True))
    except SampleError as exc:
        info["verify"] = {"ok": False, "error": exc.reason}
        return EXIT_PROBLEMS
    hidden = sample.hidden_states
    nonfinite = int((~torch.isfinite(hidden)).sum()) if hidden.numel() else 0
    info["verify"] = {
        "ok": True,
        "crc32_checked": info["crc32"] is not None,
        "nonfinite_values": nonfinite,
    }
    return EXIT_OK


def _print_inspect(info: dict[str, Any], layer_note: str, *, verified: bool, shown: int) -> None:
    lock = info["lock"]
    if info["lock"] == LockState.HELD.value:
        lock += " (a writer is still at work)"
    elif info["lock_status"] == "failed":
        lock += " (status: failed)"
    nonfinite = {None: "not recorded", False: "no", True: "YES (NaN or inf present)"}[
        info["nonfinite"]
    ]
    crc = info["crc32"] or "not recorded"
    layer_ids = info["layer_ids"]
    pairs: list[tuple[str, object]] = [
        ("file", info["path"]),
        (
            "size",
            f"{format_bytes(info['size'])} ({info['size']:,} bytes, header {info['header_bytes']})",
        ),
        ("state", info["state"] + (f": {info['reason']}" if info["reason"] else "")),
        ("lock", lock),
        ("format", info["format_version"] or "not recorded"),
        ("tokens", format_count(info["tokens"])),
        ("layers", info["layers"]),
        ("layer ids", layer_note or (layer_ids if layer_ids is not None else "not recorded")),
        ("hidden size", info["hidden"]),
        ("dtype", info["dtype"]),
        (
            "loss mask",
            "none"
            if info["loss_mask_trained"] is None
            else f"{format_count(info['loss_mask_trained'])} of {format_count(info['tokens'])} "
            "tokens trained",
        ),
        ("nonfinite", nonfinite),
        ("crc32", crc),
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
    if not v["ok"]:
        return f"FAILED: {v['error']}"
    verdict = "OK, CRC32 matches" if v["crc32_checked"] else "OK (no CRC32 recorded)"
    return verdict + f"; {v['nonfinite_values']:,} non-finite values"


def _print_tensors_and_metadata(info: dict[str, Any]) -> None:
    print("tensors:")
    rows = [
        [
            name,
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            f"{t['data_offsets'][0]}..{t['data_offsets'][1]}",
            format_bytes(t["bytes"]),
        ]
        for name, t in info["tensors"].items()
    ]
    print(format_table(["NAME", "DTYPE", "SHAPE", "OFFSETS", "BYTES"], rows, indent="  "))
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


__all__ = ["directory_stats", "register", "run_inspect", "run_ls", "run_stats"]
