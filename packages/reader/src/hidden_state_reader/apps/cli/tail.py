"""``hidden-state tail``: follow a directory and print one line per sample as it arrives."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from hidden_state_reader.apps.cli.common import PROG, add_grace_argument, require_dir
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_OK,
    CliError,
    add_command,
    format_bytes,
    non_negative_float,
    positive_int,
)
from hidden_state_reader.errors import DirectoryNotWritableError
from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.tensors import dtype_tables
from hidden_state_reader.options import WATCH_MODES
from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:  # torch-backed; imported by run_tail so `hidden-state --help` stays fast
    from hidden_state_reader.reader import HiddenStateReader
    from hidden_state_reader.sample.sample import Sample

# ReaderStats fields worth a mention in the summary when non-zero.
_SKIP_COUNTERS = (
    "incomplete",
    "corrupt",
    "failed",
    "stale_locks",
    "lock_timeouts",
    "empty",
    "claimed_elsewhere",
    "done_elsewhere",
    "reclaimed",
)


def register(subparsers: Any) -> None:
    """Add ``tail``."""
    p = add_command(
        subparsers,
        "tail",
        summary="follow a directory and print each sample as it arrives",
        description="Follow a hidden-state directory like `tail -f`: print the samples "
        "already there, then one\nline per new sample as soon as its writer is done "
        "(corrupt or failed samples are reported\non stderr and skipped). Ctrl-C stops it "
        "cleanly and prints a summary on stderr.\nSizes are tensor bytes as read "
        "(dequantized, selected layers), not file bytes (`ls`).\n\n"
        "With --claim (or --group) tail takes part in exactly-once delivery: each sample "
        "is printed\nby one of the readers of the claim group and marked consumed for that "
        "group; without it,\ntail only watches and changes nothing.",
        examples="""
hidden-state tail /data/hs
hidden-state tail /data/hs --idle-timeout 60 --max-samples 100
hidden-state tail /data/hs --claim --group audit --json
hidden-state tail /nfs/hs --watch poll          # writers on other hosts (NFS/Lustre)
""",
        handler=run_tail,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    _add_following_arguments(p)
    _add_watch_and_output_arguments(p)


def _add_following_arguments(p: argparse.ArgumentParser) -> None:
    """``tail``'s when-to-stop and claim options."""
    p.add_argument(
        "--idle-timeout",
        type=non_negative_float,
        default=None,
        metavar="S",
        help="exit after S seconds without a new sample (default: follow until Ctrl-C)",
    )
    p.add_argument(
        "--claim",
        action="store_true",
        help="claim each sample for the group, so each is printed by one reader only",
    )
    p.add_argument(
        "--group",
        metavar="G",
        default=None,
        help="claim group name (implies --claim; default group: 'default')",
    )
    p.add_argument(
        "--max-samples", type=positive_int, default=None, metavar="N", help="exit after N samples"
    )
    p.add_argument(
        "--lock-timeout",
        type=non_negative_float,
        default=600.0,
        metavar="S",
        help="longest wait for one sample's writer before it is skipped for now",
    )


def _add_watch_and_output_arguments(p: argparse.ArgumentParser) -> None:
    """``tail``'s watching, checking and output options."""
    p.add_argument(
        "--watch",
        choices=WATCH_MODES,
        default="auto",
        help="how new files are noticed: inotify events (auto) or periodic rescans (poll)",
    )
    p.add_argument(
        "--poll-interval",
        type=non_negative_float,
        default=1.0,
        metavar="S",
        help="rescan period with --watch poll",
    )
    p.add_argument(
        "--checksums", action="store_true", help="check the writer's CRC32 of each sample"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per sample (name, path, tokens, layers, hidden, dtype, "
        "tensor_bytes, request_id, layer_ids)",
    )
    add_grace_argument(p, GRACE)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def sample_record(sample: Sample) -> dict[str, Any]:
    """The fields ``tail`` prints for one sample."""
    hidden = sample.hidden_states
    return {
        "time": round(time.time(), 3),
        "name": os.path.basename(sample.path),
        "path": sample.path,
        "tokens": sample.num_tokens,
        "layers": int(hidden.shape[1]),
        "hidden": int(hidden.shape[2]),
        # The torch table is built on first use, not at import.
        "dtype": dtype_tables()[1].get(hidden.dtype, str(hidden.dtype)),
        "tensor_bytes": sample.nbytes,  # as read: dequantized, selected layers
        "request_id": sample.metadata.get(Meta.REQUEST_ID),
        "layer_ids": sample.layer_ids,
    }


def format_record(rec: dict[str, Any]) -> str:
    """One human-readable line for a sample record."""
    stamp = time.strftime("%H:%M:%S", time.localtime(rec["time"]))
    line = (
        f"{stamp}  {rec['name']:<28}  {rec['tokens']:>7,} tokens  "
        f"{rec['layers']} layers x {rec['hidden']} {rec['dtype']}  "
        f"{format_bytes(rec['tensor_bytes']):>10} tensor bytes"
    )
    if rec["request_id"]:
        line += f"  {rec['request_id']}"
    return line


def run_tail(args: argparse.Namespace) -> int:
    """``hidden-state tail``."""
    from hidden_state_reader.reader import HiddenStateReader  # torch: only when it runs

    root = require_dir(args.directory)
    claim = args.claim or args.group is not None
    try:
        reader = HiddenStateReader(
            root,
            follow=True,
            idle_timeout=args.idle_timeout,
            max_samples=args.max_samples,
            claim=claim,
            claim_group=args.group or "default",
            lock_timeout=args.lock_timeout,
            watch=args.watch,
            poll_interval=args.poll_interval,
            verify_checksum=args.checksums,
            orphan_grace=args.grace,
        )
    except (ValueError, DirectoryNotWritableError) as exc:
        raise CliError(str(exc)) from None
    how = f"claim group {args.group or 'default'}" if claim else "watch only"
    print(f"{PROG} tail: following {root} ({how}); Ctrl-C to stop", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    samples = iter(reader)
    stopped = "done"
    try:
        for sample in samples:
            rec = sample_record(sample)
            try:
                print(json.dumps(rec) if args.json else format_record(rec), flush=True)
            finally:
                reader.commit()  # printed: consumed, even if Ctrl-C comes meanwhile
        if args.max_samples is not None and reader.stats.yielded >= args.max_samples:
            stopped = f"reached --max-samples {args.max_samples}"
        elif args.idle_timeout is not None:
            stopped = f"no new sample for {args.idle_timeout:g}s"
    except KeyboardInterrupt as exc:
        stopped = "terminated" if isinstance(exc, _Terminated) else "interrupted"
    finally:
        # A second Ctrl-C must not interrupt the tidy-up (claims, watcher).
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            close = getattr(samples, "close", None)  # a generator: runs its clean-up
            if close is not None:
                close()
            reader.close()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)
    print(_summary(reader, stopped), file=sys.stderr, flush=True)
    return EXIT_OK


def _summary(reader: HiddenStateReader, stopped: str) -> str:
    s = reader.stats
    line = (
        f"{PROG} tail: {s.yielded:,} sample{'s' if s.yielded != 1 else ''}, "
        f"{s.tokens:,} tokens, {format_bytes(s.bytes)} tensor bytes ({stopped})"
    )
    others = [f"{getattr(s, k)} {k.replace('_', ' ')}" for k in _SKIP_COUNTERS if getattr(s, k)]
    if others:
        line += "; " + ", ".join(others)
    return line


__all__ = ["format_record", "register", "run_tail", "sample_record"]
