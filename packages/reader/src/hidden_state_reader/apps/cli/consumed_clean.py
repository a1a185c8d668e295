"""``hidden-state clean``'s part for consumed-key records (``format/consumed.py``).

A record lives until the ``expires_at`` its consumer wrote (``consumed_key_retention``);
``--consumed-keys-older-than S`` also forgets keys consumed at least S seconds ago. A
forgotten key is written again by its next retry.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import NamedTuple

from hidden_state_reader.apps.cli.toolkit import non_negative_float
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
