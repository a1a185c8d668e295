"""Plain-text formatting for the CLI: aligned tables, byte sizes, counts."""

from __future__ import annotations

from collections.abc import Sequence

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


def format_count(n: int | float | None, digits: int = 1) -> str:
    """Thousands-separated number (``12,345``, ``102.5``); ``-`` for None."""
    if n is None:
        return "-"
    if isinstance(n, float) and not n.is_integer():
        return f"{n:,.{digits}f}"
    return f"{int(n):,}"


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str | None = None,
    indent: str = "",
    gap: str = "  ",
) -> str:
    """Lay out rows as an aligned plain-text table.

    Args:
        headers: Column titles; an empty sequence prints no header line.
        rows: Cell values (converted with ``str``; None prints as ``-``).
        align: One letter per column, ``l`` (left) or ``r`` (right); default all left.
        indent: Prefix of every line.
        gap: Space between columns.

    Returns:
        The table, lines joined by newlines, trailing spaces stripped (no final newline).

    Example::

        >>> print(format_table(["name", "n"], [["a", 1], ["bb", 22]], align="lr"))
        name   n
        a      1
        bb    22
    """
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    ncols = max([len(headers)] + [len(r) for r in cells]) if (headers or cells) else 0
    table = ([list(headers)] if headers else []) + cells
    for row in table:
        row.extend([""] * (ncols - len(row)))
    widths = [max((len(row[i]) for row in table), default=0) for i in range(ncols)]
    modes = (align or "").ljust(ncols, "l")
    lines = []
    for row in table:
        parts = [
            cell.rjust(widths[i]) if modes[i] == "r" else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + gap.join(parts)).rstrip())
    return "\n".join(lines)


def format_pairs(pairs: Sequence[tuple[str, object]], *, indent: str = "") -> str:
    """Two-column ``key: value`` block with the values aligned."""
    return format_table([], [(f"{k}:", v) for k, v in pairs], indent=indent, gap=" ")
