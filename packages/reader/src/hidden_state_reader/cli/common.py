"""Pieces shared by the subcommands: errors, exit codes, argument checks, progress.

Also the helpers both packages' commands share (the connector's ``extract``, ``serve``
and ``demo`` too): exit codes, ``format_bytes`` / ``format_si`` / ``format_rate`` for
progress lines, ``isatty``, and ``read_token_ids``.

A subcommand (built in or from a plugin) is an ``argparse`` subparser whose defaults
carry ``handler``: a callable taking the parsed ``argparse.Namespace`` and returning the
exit status (None means 0). A handler reports bad input by raising ``CliError``, which
``main`` prints as one line and turns into exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from hidden_state_reader.format.names import DATA_SUFFIX, Kind, classify

if TYPE_CHECKING:
    from hidden_state_reader.format.header import SampleHeader

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PROBLEMS = EXIT_FAILED  # what the reader's commands call it: problems were found
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C

PROG = "hidden-state"

Handler = Callable[[argparse.Namespace], "int | None"]


class CliError(Exception):
    """Bad input (a missing directory, a file that is not a sample): one line, exit 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and the examples epilog as written; shows defaults."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "%(default)" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
            and text
        ):
            text += " (default: %(default)s)"
        return text


def add_command(
    subparsers: Any,
    name: str,
    *,
    summary: str,
    description: str,
    examples: str,
    handler: Handler,
) -> argparse.ArgumentParser:
    """Add a subcommand with a description, an examples epilog and its handler.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers``.
        name: The subcommand's name.
        summary: One line for the list of subcommands.
        description: What the subcommand does (shown by ``--help``).
        examples: Example command lines for the epilog (one per line, already formatted).
        handler: Called with the parsed arguments; returns the exit status.

    Returns:
        The subparser, to add arguments to.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog="examples:\n" + "\n".join("  " + line for line in examples.strip().splitlines()),
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(handler=handler)
    return parser


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
        "stay unchanged and still count as pending",
    )


_N = TypeVar("_N", int, float)


def _parse_number(
    text: str, cast: Callable[[str], _N], kind: str, ok: Callable[[_N], bool], rule: str
) -> _N:
    """``cast(text)`` if it parses and satisfies ``ok``, else an argparse error."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
    if not ok(value):  # comparisons are False for NaN: it is rejected too
        raise argparse.ArgumentTypeError(f"must be {rule}: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """``argparse`` type: a number of seconds, 0 or more."""
    return _parse_number(text, float, "a number", lambda v: v >= 0, "0 or more")


def positive_int(text: str) -> int:
    """``argparse`` type: an integer of 1 or more."""
    return _parse_number(text, int, "an integer", lambda v: v >= 1, "1 or more")


def positive_float(text: str) -> float:
    """``argparse`` type: a number greater than 0."""
    return _parse_number(text, float, "a number", lambda v: v > 0, "positive")


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


class Progress:
    """``progress(done, total)`` callback that prints a line on stderr every ``every`` files.

    Args:
        label: What is being done, e.g. ``"scanning /data/hs"``.
        enabled: Print at all (``--progress``, or stderr is a terminal).
        every: Files between two lines.
        stream: Where to print (stderr).
    """

    def __init__(
        self, label: str, enabled: bool, every: int = 1000, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.enabled = enabled
        self.every = every
        self.stream = stream or sys.stderr
        self.printed = False

    @classmethod
    def for_args(cls, args: argparse.Namespace, label: str) -> Progress:
        """Enabled by ``--progress`` or when stderr is a terminal."""
        wanted = bool(getattr(args, "progress", False))
        return cls(label, wanted or isatty(sys.stderr))

    def __call__(self, done: int, total: int) -> None:
        """Report that ``done`` of ``total`` files were handled."""
        if not self.enabled:
            return
        if done % self.every == 0 or (done == total and self.printed):
            print(f"{PROG}: {self.label}: {done:,}/{total:,} files", file=self.stream, flush=True)
            self.printed = True


def isatty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal; False for closed or file-less streams."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def format_si(value: float) -> str:
    """A compact count or rate: ``12345`` -> ``"12.3k"``, ``42.25`` -> ``"42.2"``.

    Thousands, millions and billions get ``k``, ``M``, ``G`` with one decimal; smaller
    non-zero values under 100 keep one decimal, the rest none.
    """
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.1f}" if value and abs(value) < 100 else f"{value:.0f}"


def format_rate(value: float, unit: str) -> str:
    """A rate with its unit: ``12345.6, "tok/s"`` -> ``"12.3k tok/s"``.

    Millions and thousands get ``M`` and ``k`` with one decimal, smaller rates none.
    """
    if value >= 1e6:
        return f"{value / 1e6:.1f}M {unit}"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k {unit}"
    return f"{value:.0f} {unit}"


def read_token_ids(path: str, header: SampleHeader, limit: int | None = None) -> list[int]:
    """The token ids of a sample file whose header was validated (no torch needed).

    Args:
        path: The sample file.
        header: Its header (``hidden_state_reader.format.read_header``).
        limit: Read only the first ``limit`` ids; None reads all of them.

    Returns:
        The ids, in file order. A file that shrank since its header was read gives
        fewer (only whole ids are decoded).

    Raises:
        OSError: The file cannot be opened or read.
    """
    info = header.tokens
    n = info.shape[0] if limit is None else min(limit, info.shape[0])
    if n <= 0:
        return []
    fmt = {"I64": "q", "I32": "i"}[info.dtype]
    size = struct.calcsize(fmt)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, n * size, header.data_start + info.begin)
    finally:
        os.close(fd)
    whole = len(raw) // size
    return list(struct.unpack(f"<{whole}{fmt}", raw[: whole * size]))


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
