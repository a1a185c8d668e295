"""``hidden-state ls`` and ``stats``: look at a directory."""

from __future__ import annotations

import argparse
import logging
import os
from collections import Counter
from typing import Any

from hidden_state_reader.apps.cli.common import (
    EMPTY_EXIT_RULE,
    EXIT_PROBLEMS,
    add_grace_argument,
    add_progress_argument,
    add_require_samples_argument,
    empty_is_failure,
    print_json,
    progress_for_args,
    require_dir,
)
from hidden_state_reader.apps.cli.table import format_count, format_pairs, format_table
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_OK,
    add_command,
    format_bytes,
)
from hidden_state_reader.files.listing import describe_empty
from hidden_state_reader.sample.health import (
    SampleHealth,
    count_states,
    scan_health,
)
from hidden_state_reader.sample.states import GRACE

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add ``ls`` and ``stats``."""
    p = add_command(
        subparsers,
        "ls",
        summary="list samples: shape, dtype, file bytes and state",
        description="List every sample of a hidden-state directory, one row each: name, "
        "tokens, captured layers, hidden size, dtype,\nfile bytes (the file's size on disk) "
        "and state (ready, pending, failed, stale, incomplete,\ncorrupt, empty; with --all "
        "also temporary files: pending or orphan_temp): the\nreader's own verdict, "
        '"(writer gone)" where the lock\'s writer ran on this host and is gone.\nNever '
        "waits for a writer: locks are only probed.",
        examples="""
hidden-state ls /data/hs
hidden-state ls /data/hs --all --bytes     # also temporary files; exact sizes
hidden-state ls /data/hs --json | jq '.[] | select(.state != "ready")'
""",
        handler=run_ls,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    p.add_argument("-a", "--all", action="store_true", help="also list temporary files")
    p.add_argument(
        "--bytes", action="store_true", help="print file bytes exactly (not as KiB, MiB)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list instead of a table: one object per sample (name, path, "
        "state, reason, lock, file_bytes, age, tokens, layers, hidden, dtype)",
    )
    add_grace_argument(p, GRACE)
    add_progress_argument(p)

    p = add_command(
        subparsers,
        "stats",
        summary="totals and distributions over a directory",
        description="Summarise a hidden-state directory: number of ready samples, total "
        "tokens and file bytes\n(on disk), captured layers, hidden sizes, dtypes, "
        "min/mean/median/max tokens per sample,\nfile bytes per token, and how many samples "
        "are in each state.\nReads no tensors (headers, and the loss mask's one byte per "
        "token): `ready` is exactly what a\nreader yields, by the reader's own rule.\n\n"
        "exit status:\n  0  ok\n  1  samples are here but none is ready or being "
        "written (nothing to train on)\n  2  bad usage (e.g. no such directory)\n"
        + EMPTY_EXIT_RULE,
        examples="""
hidden-state stats /data/hs
hidden-state stats /data/hs --json
""",
        handler=run_stats,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_require_samples_argument(p)
    add_grace_argument(p, GRACE)
    add_progress_argument(p)


# -- ls ------------------------------------------------------------------------------


def _scan(args: argparse.Namespace, *, include_temps: bool) -> list[SampleHealth]:
    root = require_dir(args.directory)
    progress = progress_for_args(args, f"scanning {root}")
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
                r.state.value + (" (writer gone)" if r.writer_gone else ""),
            ]
        )
    columns = ["NAME", "TOKENS", "LAYERS", "HIDDEN", "DTYPE", "FILE BYTES", "STATE"]
    print(format_table(columns, rows, align="lrrrlrl"))
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
    file_bytes = sum(r.size or 0 for r in ready)
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
        "file_bytes": file_bytes,
        "layers": {str(k): v for k, v in sorted(layers.items())},
        "hidden": {str(k): v for k, v in sorted(hidden.items())},
        "dtypes": dict(dtypes.most_common()),
        "min_tokens": tokens[0] if tokens else None,
        "mean_tokens": round(total_tokens / len(tokens), 2) if tokens else None,
        "median_tokens": _median(tokens),
        "max_tokens": tokens[-1] if tokens else None,
        "file_bytes_per_token": round(file_bytes / total_tokens, 2) if total_tokens else None,
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
    # A script must notice a directory with nothing to train on, now or soon; one that a
    # deleting consumer has emptied is not that (see EMPTY_EXIT_RULE).
    samples = [r for r in results if not r.is_temp]
    usable = any(r.state.usable for r in samples)
    if samples:
        rc = EXIT_OK if usable else EXIT_PROBLEMS
    else:
        rc = EXIT_PROBLEMS if empty_is_failure(args.directory, args.require_samples) else EXIT_OK
    if not results:
        log.warning("%s", describe_empty(args.directory))
    if args.json:
        print_json({"directory": os.path.abspath(args.directory), **stats})
        return rc
    states = ", ".join(f"{n} {s}" for s, n in stats["states"].items()) or "none"
    temps = ", ".join(f"{n} {s}" for s, n in stats["temp_files"].items()) or "none"
    bpt = stats["file_bytes_per_token"]
    pairs: list[tuple[str, object]] = [
        ("directory", os.path.abspath(args.directory)),
        ("ready samples", format_count(stats["count"])),
        ("total tokens", format_count(stats["total_tokens"])),
        ("file bytes", f"{format_bytes(stats['file_bytes'])} ({stats['file_bytes']:,} bytes)"),
        ("layers", _distribution(stats["layers"])),
        ("hidden size", _distribution(stats["hidden"])),
        ("dtypes", _distribution(stats["dtypes"])),
        (
            "tokens/sample",
            f"min {format_count(stats['min_tokens'])}  mean {format_count(stats['mean_tokens'])}"
            f"  median {format_count(stats['median_tokens'])}  max "
            f"{format_count(stats['max_tokens'])}",
        ),
        ("file bytes/token", "-" if bpt is None else f"{bpt:,.1f}"),
        ("states", states),
        ("temporary files", temps),
    ]
    print(format_pairs(pairs))
    return rc


__all__ = ["directory_stats", "register", "run_ls", "run_stats"]
