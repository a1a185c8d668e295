"""The CLI toolkit of both packages: what every ``hidden-state`` command is built from.

The reader's commands (``cli.listing``, ``verify``, ``tail``, ``export``, ``store``) and
the connector's (``extract``, ``serve``, ``demo``) share these, so all commands behave
alike: exit codes, ``CliError`` for bad input (one line, exit status 2), ``add_command``
(a subcommand with a description, examples and its handler, in the house style),
``argparse`` number types, ``isatty``, the number formats of progress lines and tables
(``format_si``, ``format_rate``, ``format_bytes``) and ``read_token_ids`` (token ids
of a sample without torch). It imports no torch and nothing of the reader's data path.

A subcommand (built in or from a plugin) is an ``argparse`` subparser whose defaults
carry ``handler``: a callable taking the parsed ``argparse.Namespace`` and returning the
exit status (None means 0).
"""

from __future__ import annotations

import argparse
import os
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from hidden_state_reader.errors import InputError

if TYPE_CHECKING:
    from hidden_state_reader.format.header import SampleHeader

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


Handler = Callable[[argparse.Namespace], "int | None"]


CliError = InputError
"""Bad input (a missing directory, a file that is not a sample): one line, exit 2.

The library's ``InputError``, so a library function (``hidden_state_connector.layers``)
can raise it without importing the CLI."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and the examples epilog as written; shows defaults.

    A default is appended once, and only where it says something: not when the help
    already names the default, not for a flag (``--no-checksum``'s ``True``), not for an
    empty list or mapping.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            text
            and action.option_strings
            and action.nargs != 0
            and "default" not in text
            and default is not None
            and default is not argparse.SUPPRESS
            and default not in ([], {})
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


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None) -> str:
    """Human-readable size: ``1023 B``, ``1.5 KiB``, ``12.0 GiB``; ``-`` for None.

    Whole bytes are rounded (``1023.6`` -> ``1024 B``); larger sizes get one decimal, up
    to PiB. The one size format of both packages' tables and progress lines.
    """
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def read_token_ids(path: str, header: SampleHeader, limit: int | None = None) -> list[int]:
    """The token ids of a sample file whose header was validated (no torch needed).

    Args:
        path: The sample file.
        header: Its header (``hidden_state_reader.read_header``).
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
