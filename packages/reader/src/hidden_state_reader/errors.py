"""Typed errors. Every error about a sample names the file it concerns."""

from __future__ import annotations

import os


class HiddenStateError(Exception):
    """Base class of every error raised by this package."""


class InputError(HiddenStateError):
    """Bad input a caller gave (a model id, a directory, an option value).

    The message is one line that names the input and what to do. The ``hidden-state``
    command reports it without a traceback, exit status 2 (``apps.cli.toolkit.CliError``
    is this class).
    """


class SampleError(HiddenStateError):
    """A sample file cannot be used.

    Attributes:
        path: The file concerned.
        reason: A short human-readable explanation.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class IncompleteSampleError(SampleError):
    """The file is shorter than its header says: a writer died or is still writing."""


class CorruptSampleError(SampleError):
    """The file is not a valid hidden-state sample (bad header, dtype, shape, names)."""


class FailedSampleError(SampleError):
    """The writer gave up on this sample and said why in the lock file."""


class StaleLockError(SampleError):
    """A lock file whose writer is gone and whose data file never appeared."""


class LockTimeoutError(SampleError):
    """The writer still held the sample's lock when the per-sample timeout ran out."""


class PathOutsideRootError(HiddenStateError):
    """A requested path would resolve outside the storage root."""

    def __init__(self, path: str, root: str, reason: str) -> None:
        self.path = path
        self.root = root
        self.reason = reason
        super().__init__(f"refusing path {path!r} (root {root!r}): {reason}")


class WaitCancelledError(HiddenStateError):
    """A blocking wait was cancelled, for example by ``HiddenStateReader.close()``."""


class DirectoryNotWritableError(HiddenStateError, PermissionError):
    """A reader mode needs to write a directory this process may not write.

    Raised by ``HiddenStateReader`` before the first sample, so a training loop learns at
    once that ``claim=True``, ``on_consumed="delete"`` or ``"move"`` cannot work (instead
    of reading everything while deleting nothing).

    Attributes:
        directory: The directory concerned.
        mode: The option that needs it (``claim=True``, ``on_consumed='delete'``, ...).
        missing: The permission that is missing, in words.
    """

    def __init__(self, directory: str, mode: str, missing: str, why: str) -> None:
        self.directory = directory
        self.mode = mode
        self.missing = missing
        super().__init__(f"{directory}: {mode} needs {missing} on this directory ({why})")
