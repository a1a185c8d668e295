"""Errors of the offline extraction that are the user's to fix."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input or options (a missing file, bad JSON, conflicting keys): exit status 2.

    The message is one line and names the file, option or key concerned.
    """
