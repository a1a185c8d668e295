"""Plain-text formatting for the reader's commands: aligned tables, counts, pairs.

Byte sizes: ``toolkit.format_bytes`` (shared with the connector's commands).
"""

from __future__ import annotations

from collections.abc import Sequence


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
