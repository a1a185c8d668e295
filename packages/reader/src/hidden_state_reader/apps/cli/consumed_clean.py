"""``hidden-state clean``'s part for consumed-key records (``format/consumed.py``).

A record lives until the ``expires_at`` its consumer wrote (``consumed_key_retention``);
``--consumed-keys-older-than S`` also forgets keys consumed at least S seconds ago. A
forgotten key is written again by its next retry. ``hidden-state clean
mooncake://HOST:PORT/PREFIX`` does the same for a store's records
(``store/consumed.py``), which is all there is to clean in a store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import NamedTuple

from hidden_state_reader.apps.cli.common import EXIT_PROBLEMS, print_json
from hidden_state_reader.apps.cli.table import format_table
from hidden_state_reader.apps.cli.toolkit import EXIT_OK, non_negative_float
from hidden_state_reader.read.consumed_keys import expired_records

CONSUMED_RECORD = "consumed-key record"


def add_consumed_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--consumed-keys-older-than``."""
    parser.add_argument(
        "--consumed-keys-older-than",
        type=non_negative_float,
        default=None,
        metavar="S",
        help="also forget the idempotency keys consumed at least S seconds ago (their "
        "records in .consumed/ are removed: a retry of such a key is written again). "
        "Without it, clean removes only the records past the retention their consumer set",
    )


class RecordRemoval(NamedTuple):
    """One record ``clean`` considered: the fields of ``cli.verify.Removal``, in order."""

    path: str
    what: str
    why: str
    file_bytes: int | None
    outcome: str
    detail: str = ""


def expire_consumed_keys(
    root: str, *, older_than: float | None, dry_run: bool
) -> list[RecordRemoval]:
    """Remove (unless ``dry_run``) the consumed-key records that have expired.

    Args:
        root: The storage directory.
        older_than: Also the records of keys consumed at least this many seconds ago.
        dry_run: Decide, but remove nothing.

    Returns:
        One entry per record removed (or that would be, or could not be).
    """
    why = "its retention has passed"
    if older_than is not None:
        why = f"expired, or consumed at least {older_than:g}s ago"
    out = []
    for path in expired_records(root, time.time(), older_than):
        size = None
        with contextlib.suppress(OSError):
            size = os.stat(path).st_size
        outcome, detail = "would remove", ""
        if not dry_run:
            try:
                os.unlink(path)
                outcome = "removed"
            except FileNotFoundError:
                outcome, detail = "skipped", "already gone"
            except OSError as exc:
                outcome, detail = "error", str(exc)
        out.append(RecordRemoval(path, CONSUMED_RECORD, why, size, outcome, detail))
    return out


def expire_store_keys(url: str, *, older_than: float | None, dry_run: bool) -> list[RecordRemoval]:
    """``expire_consumed_keys`` for a store: its ``consumed/NAME`` records.

    Raises:
        ValueError: A bad URL.
        StoreError: The store cannot be joined (names the master).
    """
    from hidden_state_reader.store.client import StoreClient, StoreError
    from hidden_state_reader.store.consumed import expired_records as store_records
    from hidden_state_reader.store.url import parse_store_url, store_url

    settings = parse_store_url(url)
    client = StoreClient(settings, where=store_url(settings))
    why = "its retention has passed"
    if older_than is not None:
        why = f"expired, or consumed at least {older_than:g}s ago"
    out = []
    try:
        for _name, key in list(store_records(client, time.time(), older_than)):
            outcome, detail = "would remove", ""
            if not dry_run:
                try:
                    gone = client.remove(key)
                    outcome, detail = ("removed", "") if gone else ("skipped", "already gone")
                except StoreError as exc:
                    outcome, detail = "error", str(exc)
            out.append(RecordRemoval(key, CONSUMED_RECORD, why, None, outcome, detail))
    finally:
        client.close()
    return out


def run_clean_store(args: argparse.Namespace) -> int:
    """``hidden-state clean mooncake://...``: expire the store's consumed-key records."""
    url = args.directory
    plan = expire_store_keys(url, older_than=args.consumed_keys_older_than, dry_run=args.dry_run)
    rc = EXIT_PROBLEMS if any(p.outcome == "error" for p in plan) else EXIT_OK
    if args.json:
        print_json({"store": url, "dry_run": args.dry_run, "files": [p._asdict() for p in plan]})
        return rc
    if plan:
        rows = [[p.outcome, p.what, p.path, p.detail or p.why] for p in plan]
        print(format_table(["ACTION", "KIND", "KEY", "DETAIL"], rows))
    removed = sum(p.outcome in ("removed", "would remove") for p in plan)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {removed} consumed-key record{'s' if removed != 1 else ''} in {url}")
    return rc
