"""Pieces the reader's own subcommands share: arguments, input checks, progress, JSON.

What the connector's commands use too lives in ``toolkit`` (exit codes, ``CliError``,
``add_command``, number types and formats).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from hidden_state_reader.apps.cli.progress import ProgressReporter
from hidden_state_reader.apps.cli.toolkit import EXIT_FAILED, CliError, isatty, non_negative_float
from hidden_state_reader.files.listing import sample_subfolders
from hidden_state_reader.format.names import DATA_SUFFIX, Kind, classify

EXIT_PROBLEMS = EXIT_FAILED  # what the reader's commands call it: problems were found

PROG = "hidden-state"


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--progress`` (progress lines on stderr even when it is not a terminal)."""
    parser.add_argument(
        "--progress",
        action="store_true",
        help="print a progress line on stderr every 1000 files (automatic on a terminal)",
    )


def add_grace_argument(parser: argparse.ArgumentParser, default: float) -> None:
    """Add ``--grace S`` (how long an unfinished-looking file counts as in progress)."""
    parser.add_argument(
        "--grace",
        type=non_negative_float,
        default=default,
        metavar="S",
        help="seconds a lock without data, or an unlocked truncated/temporary file, may "
        "stay unchanged and still count as pending. A lock whose writer ran on this host "
        "and is gone (its process no longer runs) is stale at once; the reason says "
        "which case applies",
    )


EMPTY_EXIT_RULE = (
    'A directory without samples exits 0: a consumer with on_consumed="delete" empties a\n'
    "healthy live directory (a warning on stderr says what is there). It exits 1 with\n"
    "--require-samples, or when its samples are all in sub-folders (one level too high)."
)
"""How ``verify`` and ``stats`` treat a directory without samples (their ``--help``)."""


def add_require_samples_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--require-samples`` (a directory without samples is a failure, exit 1)."""
    parser.add_argument(
        "--require-samples",
        action="store_true",
        help="a directory without samples is a failure (exit status 1): for a job that "
        "must have produced something, not for a directory consumers empty",
    )


def empty_is_failure(root: str, require_samples: bool) -> bool:
    """Whether a directory without samples fails the command (see ``EMPTY_EXIT_RULE``).

    Args:
        root: The directory, which holds no sample.
        require_samples: ``--require-samples`` was given.
    """
    return require_samples or bool(sample_subfolders(root))


def require_dir(path: str) -> str:
    """Return ``path`` if it is an existing directory, else raise ``CliError`` naming it."""
    if not os.path.exists(path):
        raise CliError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise CliError(f"{path}: not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CliError(f"{path}: permission denied")
    return path


def require_sample_file(path: str) -> str:
    """Return ``path`` if it names an existing ``*.safetensors`` file, else ``CliError``."""
    if not os.path.lexists(path):
        raise CliError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CliError(f"{path}: is a directory (expected a NAME{DATA_SUFFIX} sample file)")
    if not os.path.isfile(path):
        raise CliError(f"{path}: not a regular file")
    if classify(os.path.basename(path)) is not Kind.DATA:
        raise CliError(f"{path}: not a sample file (expected a NAME{DATA_SUFFIX} file)")
    return path


FileProgress = Callable[[int, int], None]
"""``progress(done, total)``: told after each file a command handled."""


def file_progress(
    label: str, enabled: bool, every: int = 1000, stream: TextIO | None = None
) -> FileProgress:
    """A ``progress(done, total)`` callback that prints a line every ``every`` files.

    Args:
        label: What is being done, e.g. ``"scanning /data/hs"``.
        enabled: Print at all (``--progress``, or stderr is a terminal).
        every: Files between two lines.
        stream: Where to print (stderr).
    """
    reporter = ProgressReporter(stream, inline=False, enabled=enabled)

    def report(done: int, total: int) -> None:
        if done % every == 0 or (done == total and reporter.shown):
            reporter.show(f"{PROG}: {label}: {done:,}/{total:,} files")

    return report


def progress_for_args(args: argparse.Namespace, label: str) -> FileProgress:
    """``file_progress``, enabled by ``--progress`` or when stderr is a terminal."""
    wanted = bool(getattr(args, "progress", False))
    return file_progress(label, wanted or isatty(sys.stderr))


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
