"""``hidden-state verify`` (find problems) and ``clean`` (remove leftovers safely).

``clean`` only ever removes lock files and temporary files, never a data file, and
re-checks each candidate at the moment of removal:

* a lock file is removed while ``clean`` itself holds ``LOCK_EX`` on it (so no writer
  or reader holds it), after checking that the name still refers to the inode it
  locked (a new writer replaces lock files by rename) and, for a stale or failed lock,
  that the data file has still not appeared; a stale lock whose writer is known to be
  gone (it ran on this host: ``files.identity.check_writer``) needs no ``--older-than``
  wait, but must still name that writer when it is removed;
* a temporary file is removed only if the lock protecting it is still not held and it
  is still unchanged for ``--older-than`` seconds, or, at once, that lock still names a
  writer known to be gone (``health.check_temp``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from hidden_state_reader.apps.cli.common import (
    EMPTY_EXIT_RULE,
    EXIT_PROBLEMS,
    FileProgress,
    add_grace_argument,
    add_progress_argument,
    add_require_samples_argument,
    empty_is_failure,
    print_json,
    progress_for_args,
    require_dir,
)
from hidden_state_reader.apps.cli.consumed_clean import (
    add_consumed_argument,
    expire_consumed_keys,
    run_clean_store,
)
from hidden_state_reader.apps.cli.table import format_table
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_OK,
    add_command,
    format_bytes,
    non_negative_float,
)
from hidden_state_reader.files.held_files import try_lock_exclusive
from hidden_state_reader.files.identity import WriterFate, check_writer
from hidden_state_reader.files.listing import describe_empty
from hidden_state_reader.files.locks import probe, read_status, read_status_fd
from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.lock_status import LockState
from hidden_state_reader.format.names import LOCK_SUFFIX
from hidden_state_reader.sample.health import (
    SampleHealth,
    count_states,
    scan_health,
    temp_owner_lock,
)
from hidden_state_reader.sample.states import GRACE, SampleState

log = logging.getLogger(__name__)

_ORPHAN_TEMP = "orphan temp file"
_DEAD_WRITER_TEMP = "orphan temp file (writer gone)"
_TEMPS = (_ORPHAN_TEMP, _DEAD_WRITER_TEMP)
_READY_LOCK = "lock of ready sample"
_DEAD_WRITER_LOCK = "stale lock (writer gone)"

_CLEANABLE = (SampleState.STALE, SampleState.FAILED, SampleState.ORPHAN_TEMP)


def register(subparsers: Any) -> None:
    """Add ``verify`` and ``clean``."""
    _register_verify(subparsers)
    _register_clean(subparsers)


def _register_verify(subparsers: Any) -> None:
    """Add ``verify``."""
    p = add_command(
        subparsers,
        "verify",
        summary="find corrupt, incomplete and failed samples, stale locks, orphan temp files",
        description="Check every sample of a hidden-state directory without waiting for "
        "writers and report\nthe problems, one line each: corrupt or incomplete data "
        "files, samples their writer\nreported as failed, stale locks (writer gone, no "
        "data), orphan temporary files.\nSamples still being written (pending) are not "
        "problems.\n\n"
        "With --checksums every sample's data is read and its CRC32 checked; files without "
        'one are\ncounted ("N of M files have no CRC32"): corruption there cannot be '
        "detected.\n\n"
        "exit status:\n  0  no problems\n  1  problems found (with --require-checksums: "
        "also a file without a CRC32)\n  2  bad usage (e.g. no such directory)\n" + EMPTY_EXIT_RULE,
        examples="""
hidden-state verify /data/hs
hidden-state verify /data/hs --checksums          # also read all data and check CRC32s
hidden-state verify /data/hs --require-checksums  # and fail on files without a CRC32
hidden-state verify /data/hs --json > report.json
""",
        handler=run_verify,
    )
    p.add_argument("directory", metavar="DIR", help="the hidden-state directory")
    p.add_argument(
        "--checksums",
        action="store_true",
        help="read every sample's data and check the writer's CRC32 (slower); says how "
        "many files carry no CRC32",
    )
    p.add_argument(
        "--require-checksums",
        action="store_true",
        help="like --checksums, and a file without a CRC32 is a problem (exit status 1)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON report: directory, ok, samples, states, problems (one object "
        "per problem, as `ls --json`), undecided (free locks without data still in their "
        "grace period), checksums",
    )
    add_require_samples_argument(p)
    add_grace_argument(p, GRACE)
    add_progress_argument(p)


def _register_clean(subparsers: Any) -> None:
    """Add ``clean``."""
    p = add_command(
        subparsers,
        "clean",
        summary="remove orphan temp files and stale/failed lock files",
        description="Remove what dead or failed writers left behind: orphan temporary "
        "files, and lock files\nof samples whose data never appeared (stale or failed). "
        "With --locks, also the lock\nfiles of complete samples (their lock is free, so "
        "they are no longer needed).\nNever removes a data file, a held lock, or anything "
        "modified less than --older-than\nseconds ago. Prints every file it removes.",
        examples="""
hidden-state clean /data/hs --dry-run         # show what would be removed
hidden-state clean /data/hs
hidden-state clean /data/hs --older-than 0 --locks
hidden-state clean /data/hs --grace 0 --json  # --grace is --older-than
hidden-state clean mooncake://10.0.0.5:50051/hs   # a store: its consumed-key records
""",
        handler=run_clean,
    )
    p.add_argument(
        "directory",
        metavar="DIR",
        help="the hidden-state directory, or a mooncake://HOST:PORT/PREFIX store (only its "
        "expired consumed-key records are removed: a store keeps no locks or temp files)",
    )
    p.add_argument(
        "-n", "--dry-run", action="store_true", help="print what would be removed; remove nothing"
    )
    p.add_argument(
        "--older-than",
        "--grace",
        dest="older_than",
        type=non_negative_float,
        default=GRACE,
        metavar="S",
        help="only remove files unchanged for at least S seconds; also the grace period "
        "that decides what is stale or orphaned (--grace is the same option, as in the "
        "other commands). A lock whose writer ran on this host and is gone is stale at "
        "once and removed whatever S",
    )
    p.add_argument(
        "--locks",
        action="store_true",
        help="also remove the free lock files of complete (ready) samples",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON report: directory, dry_run, files (path, what, why, file_bytes, "
        "outcome, detail for each file considered)",
    )
    add_progress_argument(p)
    add_consumed_argument(p)


# -- verify --------------------------------------------------------------------------


def run_verify(args: argparse.Namespace) -> int:
    """``hidden-state verify``."""
    root = require_dir(args.directory)
    checksums = args.checksums or args.require_checksums
    progress = progress_for_args(args, f"verifying {root}")
    results = list(scan_health(root, progress, checksums=checksums, grace=args.grace))
    samples = [r for r in results if not r.is_temp]
    temps = [r for r in results if r.is_temp]
    problems = [r for r in results if r.problem]
    # Free locks without data that only the grace period can judge: said, not hidden.
    undecided = [r for r in samples if r.state is SampleState.PENDING and r.writer is not None]
    crc = _checksum_report(samples) if checksums else None
    missing_crc = bool(args.require_checksums and crc is not None and crc["missing"])
    empty_fails = not samples and empty_is_failure(root, args.require_samples)
    rc = EXIT_PROBLEMS if problems or empty_fails or missing_crc else EXIT_OK
    if not samples:
        log.warning("%s", describe_empty(root))
    if args.json:
        print_json(
            {
                "directory": os.path.abspath(root),
                "ok": rc == EXIT_OK,
                "samples": len(samples),
                "temp_files": len(temps),
                "checksums_verified": crc["verified"] if crc is not None else None,
                "checksums": crc,
                "states": count_states(samples),
                "temp_states": count_states(temps),
                "problems": [r.as_dict() for r in problems],
                "undecided": [r.as_dict() for r in undecided],
            }
        )
        return rc
    _print_verify_report(
        root,
        samples,
        temps,
        problems,
        undecided,
        crc,
        require_checksums=args.require_checksums,
        missing_crc=missing_crc,
    )
    return rc


def _print_verify_report(
    root: str,
    samples: list[SampleHealth],
    temps: list[SampleHealth],
    problems: list[SampleHealth],
    undecided: list[SampleHealth],
    crc: dict[str, Any] | None,
    *,
    require_checksums: bool,
    missing_crc: bool,
) -> None:
    """``verify``'s text report: the problem table, then the summary lines."""
    if problems:
        rows = [[r.state.value, r.name, r.reason] for r in problems]
        print(format_table(["PROBLEM", "NAME", "REASON"], rows))
    states = ", ".join(f"{n} {s}" for s, n in count_states(samples).items()) or "none"
    plural = "s" if len(samples) != 1 else ""
    line = f"checked {len(samples)} sample{plural} in {root}: {states}"
    if temps:
        line += f"; {len(temps)} temporary file{'s' if len(temps) != 1 else ''}"
    if crc is not None:
        line += f"; {crc['verified']} CRC32{'s' if crc['verified'] != 1 else ''} verified"
    print(line)
    if crc is not None and crc["missing"]:
        print(
            f"{crc['missing']} of {crc['checked']} files have no CRC32: corruption there "
            "cannot be detected"
            + (" (--require-checksums: a problem)" if require_checksums else "")
        )
    for r in undecided[:5]:
        print(f"pending {r.name}: {r.reason}")
    if len(undecided) > 5:
        print(f"... and {len(undecided) - 5} more free locks without data (see --json)")
    if problems:
        n = len(problems)
        print(f"{n} problem{'s' if n != 1 else ''} found ({_clean_hint(problems, root)})")
    elif not samples:
        print(f"no samples found in {root}")
    elif missing_crc:
        print("no other problems found")
    else:
        print("no problems found")


def _checksum_report(samples: list[SampleHealth]) -> dict[str, Any]:
    """CRC32 coverage of the files whose data was read.

    Those are the samples with a header that no writer holds: how many were checked, how
    many CRC32s matched, and which files carry none.
    """
    checked = [r for r in samples if r.header is not None and r.lock is not LockState.HELD]
    missing = [
        r.name for r in checked if r.header is not None and Meta.CRC32 not in r.header.metadata
    ]
    return {
        "checked": len(checked),
        "verified": sum(1 for r in checked if r.checksum_verified),
        "missing": len(missing),
        "missing_files": missing,
    }


def _clean_hint(problems: list[SampleHealth], root: str) -> str:
    """What ``clean`` would do about ``problems``, in a few words."""
    locks = sum(1 for r in problems if r.state in (SampleState.STALE, SampleState.FAILED))
    temps = sum(1 for r in problems if r.state is SampleState.ORPHAN_TEMP)
    data = len(problems) - locks - temps
    removes = [
        f"{n} {what}{'s' if n != 1 else ''}"
        for n, what in ((locks, "stale/failed lock"), (temps, "orphan temp file"))
        if n
    ]
    if not removes:
        them = "it" if data == 1 else "them"
        return f"`hidden-state clean` never removes data files: delete {them} by hand"
    hint = f"`hidden-state clean {root}` removes the {' and the '.join(removes)}"
    if data:
        hint += f"; the {data} data file{'s' if data != 1 else ''} it never removes"
    return hint


# -- clean ---------------------------------------------------------------------------


@dataclass
class Removal:
    """One file ``clean`` considered.

    Attributes:
        path: The file.
        what: What it is (``orphan temp file``, ``stale lock``, ...).
        why: The health verdict's reason.
        file_bytes: Its size on disk in bytes (None if it is gone).
        outcome: ``removed``, ``would remove`` (dry run), ``kept`` (decided not to:
            still being written, too young, a data file), ``skipped`` (changed at the
            moment of removal) or ``error``.
        detail: Why it was kept or skipped, or the error.
    """

    path: str
    what: str
    why: str
    file_bytes: int | None = None
    outcome: str = ""
    detail: str = ""


def _candidates(results: list[SampleHealth], *, locks: bool, older_than: float) -> list[Removal]:
    out = []
    for r in results:
        item = _candidate(r, locks=locks)
        if item is None:
            continue
        item.file_bytes = _file_bytes(item.path)
        young = r.age is not None and r.age < older_than and not r.writer_gone
        if not item.outcome and young:
            item.outcome = "kept"
            item.detail = f"modified {r.age:.0f}s ago, less than --older-than {older_than:g}s"
        out.append(item)
    return out


def _candidate(r: SampleHealth, *, locks: bool) -> Removal | None:
    """What ``clean`` does with one entry: remove it, keep it (saying why), or ignore it."""
    if r.is_temp:
        if r.state is SampleState.ORPHAN_TEMP:
            return Removal(r.path, _DEAD_WRITER_TEMP if r.writer_gone else _ORPHAN_TEMP, r.reason)
        return Removal(r.path, "temp file", r.reason, outcome="kept", detail=r.reason)
    if r.state in (SampleState.STALE, SampleState.FAILED):
        what = _DEAD_WRITER_LOCK if r.writer_gone else f"{r.state.value} lock"
        return Removal(_lock(r), what, r.reason)
    if r.state is SampleState.READY and r.lock is LockState.FREE:
        if locks:
            return Removal(_lock(r), _READY_LOCK, "sample complete, lock free")
        return None
    if r.state is SampleState.PENDING:
        what = "lock" if r.lock is not LockState.ABSENT else "data file"
        detail = f"still being written: {r.reason}"
        return Removal(r.lock_path or r.path, f"pending {what}", r.reason, None, "kept", detail)
    if r.state.is_problem:
        detail = f"{r.reason}; clean never removes data files (delete it by hand)"
        return Removal(r.path, f"{r.state.value} data file", r.reason, None, "kept", detail)
    return None


def _lock(r: SampleHealth) -> str:
    path = r.lock_path
    assert path is not None
    return path


def _file_bytes(path: str) -> int | None:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return None


def _age(path: str) -> float:
    return time.time() - os.stat(path).st_mtime


def remove_lock(
    lock_file: str, *, older_than: float, require_no_data: bool, writer_gone: bool = False
) -> str | None:
    """Remove a lock file if nobody holds it; the caller decided it is not needed.

    The file is locked ``LOCK_EX`` (non-blocking) for the duration of the checks and the
    unlink, so a writer cannot hold it meanwhile, and it must still be the inode that
    was locked (writers replace lock files by rename).

    Args:
        lock_file: ``NAME.safetensors.lock``.
        older_than: Leave it if modified less than this many seconds ago.
        require_no_data: Leave it if ``NAME.safetensors`` exists (stale/failed locks).
        writer_gone: Instead of ``older_than``: leave it unless the status in it still
            names a writer that is gone (``check_writer``).

    Returns:
        None if it was removed, otherwise why it was left.
    """
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "already gone"
    try:
        if not try_lock_exclusive(fd):
            return "in use: a writer or reader holds it now"
        mine = os.fstat(fd)
        try:
            current = os.stat(lock_file)
        except FileNotFoundError:
            return "already gone"
        if (mine.st_dev, mine.st_ino) != (current.st_dev, current.st_ino):
            return "replaced by a new writer"
        if writer_gone:
            if check_writer(read_status_fd(fd)).fate is not WriterFate.GONE:
                return "rewritten by a writer that is not known to be gone"
        elif time.time() - current.st_mtime < older_than:
            return f"modified less than {older_than:g}s ago"
        if require_no_data and os.path.lexists(lock_file[: -len(LOCK_SUFFIX)]):
            return "its data file has appeared"
        os.unlink(lock_file)
        return None
    finally:
        os.close(fd)


def remove_temp(temp_file: str, *, older_than: float, writer_gone: bool = False) -> str | None:
    """Remove a temporary file if no writer owns it (see ``health.check_temp``).

    Args:
        temp_file: ``NAME.safetensors.tmp.<id>`` (or a lock file's temporary).
        older_than: Leave it if modified less than this many seconds ago.
        writer_gone: Instead of ``older_than``: leave it unless its free lock still names
            a writer that is gone (``check_writer``).

    Returns:
        None if it was removed, otherwise why it was left.
    """
    owner = temp_owner_lock(temp_file)
    if owner == temp_file:
        # A lock file being created: it is locked before it is renamed into place.
        return remove_lock(
            temp_file, older_than=older_than, require_no_data=False, writer_gone=writer_gone
        )
    if owner is not None and probe(owner) is LockState.HELD:
        return f"in use: {os.path.basename(owner)} is held"
    try:
        if writer_gone:
            # Re-read now: a new writer of the name replaces the lock (by rename) first.
            if owner is None or check_writer(read_status(owner)).fate is not WriterFate.GONE:
                return "its lock now names a writer that is not known to be gone"
        elif _age(temp_file) < older_than:
            return f"modified less than {older_than:g}s ago"
        os.unlink(temp_file)
    except FileNotFoundError:
        return "already gone"
    return None


def clean_directory(
    root: str,
    *,
    older_than: float = GRACE,
    locks: bool = False,
    dry_run: bool = False,
    progress: FileProgress | None = None,
) -> list[Removal]:
    """Find and (unless ``dry_run``) remove leftovers of dead or failed writers.

    Args:
        root: The storage directory.
        older_than: Grace period: nothing modified more recently is touched, and a
            temporary file or data-less lock only counts as abandoned after it.
        locks: Also remove free lock files of ready samples.
        dry_run: Decide, but remove nothing.
        progress: Scan progress callback.

    Returns:
        Every file considered, with its outcome.
    """
    results = list(scan_health(root, progress, grace=older_than))
    plan = _candidates(results, locks=locks, older_than=older_than)
    # Temporary files first: a temp file's lock is the evidence that its writer is gone.
    for item in sorted(plan, key=lambda item: item.what not in _TEMPS):
        if item.outcome:  # kept
            continue
        if dry_run:
            item.outcome = "would remove"
            continue
        try:
            if item.what in _TEMPS:
                skip = remove_temp(
                    item.path, older_than=older_than, writer_gone=item.what == _DEAD_WRITER_TEMP
                )
            else:
                skip = remove_lock(
                    item.path,
                    older_than=older_than,
                    require_no_data=item.what != _READY_LOCK,
                    writer_gone=item.what == _DEAD_WRITER_LOCK,
                )
        except OSError as exc:
            item.outcome, item.detail = "error", str(exc)
            continue
        item.outcome = "skipped" if skip else "removed"
        item.detail = skip or ""
    return plan


def run_clean(args: argparse.Namespace) -> int:
    """``hidden-state clean``."""
    from hidden_state_reader.store.url import is_store_url  # numpy: not at start-up

    if is_store_url(args.directory):
        return run_clean_store(args)
    root = require_dir(args.directory)
    plan = clean_directory(
        root,
        older_than=args.older_than,
        locks=args.locks,
        dry_run=args.dry_run,
        progress=progress_for_args(args, f"scanning {root}"),
    )
    records = expire_consumed_keys(
        root, older_than=args.consumed_keys_older_than, dry_run=args.dry_run
    )
    plan += [Removal(*record) for record in records]
    errors = [p for p in plan if p.outcome == "error"]
    removed = [p for p in plan if p.outcome in ("removed", "would remove")]
    rc = EXIT_PROBLEMS if errors else EXIT_OK
    if args.json:
        print_json(
            {
                "directory": os.path.abspath(root),
                "dry_run": args.dry_run,
                "files": [vars(p) for p in plan],
            }
        )
        return rc
    if plan:
        rows = [[p.outcome, p.what, os.path.relpath(p.path, root), p.detail or p.why] for p in plan]
        print(format_table(["ACTION", "KIND", "FILE", "DETAIL"], rows))
    verb = "would remove" if args.dry_run else "removed"
    nbytes = sum(p.file_bytes or 0 for p in removed)
    line = f"{verb} {len(removed)} file{'s' if len(removed) != 1 else ''}"
    if nbytes:
        line += f" ({format_bytes(nbytes)})"
    line += f" in {root}"
    skipped = sum(1 for p in plan if p.outcome == "skipped")
    if skipped:
        line += f"; {skipped} skipped"
    kept = sum(1 for p in plan if p.outcome == "kept")
    if kept:
        line += f"; {kept} kept (see DETAIL)"
    if errors:
        line += f"; {len(errors)} could not be removed"
    print(line)
    return rc


__all__ = [
    "Removal",
    "clean_directory",
    "register",
    "remove_lock",
    "remove_temp",
    "run_clean",
    "run_verify",
]
