"""Errors of the offline extraction that are the user's to fix, and how reasons are told."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input or options (a missing file, bad JSON, conflicting keys): exit status 2.

    The message is one line and names the file, option or key concerned.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none).

    What a failed sample records as its reason: vLLM and tokenizer errors can span many
    lines, a manifest line and a summary line hold one.
    """
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
