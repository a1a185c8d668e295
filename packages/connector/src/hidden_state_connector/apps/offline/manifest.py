"""``manifest.jsonl``: the append-only record of an extraction run, and its run lock.

One JSON object per line. Sample lines (the last line of an index wins)::

    {"index": 7, "status": "ok", "file": "hs_7.safetensors", "tokens": 412,
     "prompt_tokens": 412, "bytes": 634912, "time": 1717171717.5}
    {"index": 8, "status": "failed", "error": "invalid JSON: ...", "time": ...}

Run lines carry ``"event"`` (``"start"`` with the settings that shape the files, or
``"end"`` with the totals). A sample is appended only after its file is final and
verified, so after a crash the manifest never claims more than what is on disk; a torn
last line (a kill in the middle of a write) is ignored when read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from hidden_state_connector.apps.offline.errors import UsageError
from hidden_state_reader.files.held_files import try_lock_exclusive

MANIFEST_NAME = "manifest.jsonl"
RUN_LOCK_NAME = ".extract.lock"
FILE_PREFIX = "hs_"
STATUS_OK = "ok"
STATUS_FAILED = "failed"


def sample_name(index: int) -> str:
    """The file name of sample ``index`` (speculators' naming): ``hs_{index}.safetensors``."""
    return f"{FILE_PREFIX}{index}.safetensors"


@dataclass(frozen=True)
class SampleRecord:
    """What the manifest says about one sample.

    Attributes:
        index: Position in the input.
        status: ``"ok"`` or ``"failed"``.
        file: File name relative to the output directory (ok samples).
        tokens: Tokens in the file (prompt, plus generated ones with output tokens).
        prompt_tokens: Tokens of the prompt.
        bytes: File size.
        error: Why the sample failed.
    """

    index: int
    status: str
    file: str | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    bytes: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The sample's file was written and verified."""
        return self.status == STATUS_OK

    def to_json(self) -> dict[str, Any]:
        """The manifest line (without ``None`` fields)."""
        doc: dict[str, Any] = {"index": self.index, "status": self.status}
        for key in ("file", "tokens", "prompt_tokens", "bytes", "error"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SampleRecord | None:
        """Parse a manifest line; None if it is not a valid sample line."""
        index, status = doc.get("index"), doc.get("status")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return None
        if status not in (STATUS_OK, STATUS_FAILED):
            return None

        def number(key: str) -> int | None:
            value = doc.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        file, error = doc.get("file"), doc.get("error")
        return cls(
            index=index,
            status=status,
            file=file if isinstance(file, str) else None,
            tokens=number("tokens"),
            prompt_tokens=number("prompt_tokens"),
            bytes=number("bytes"),
            error=str(error) if error is not None else None,
        )


class Manifest:
    """The manifest of one output directory: its current state and an appender.

    Args:
        directory: The output directory (``manifest.jsonl`` lives in it).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, MANIFEST_NAME)
        self.samples: dict[int, SampleRecord] = {}
        self.events: list[dict[str, Any]] = []
        self.ignored_lines = 0
        self._fd: int | None = None
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return
        for raw in lines:
            if not raw.strip():
                continue
            try:
                doc = json.loads(raw)
            except ValueError:
                self.ignored_lines += 1  # torn by a kill mid-write: the sample is redone
                continue
            if not isinstance(doc, dict):
                self.ignored_lines += 1
            elif "event" in doc:
                self.events.append(doc)
            elif (record := SampleRecord.from_json(doc)) is not None:
                self.samples[record.index] = record
            else:
                self.ignored_lines += 1

    def last_start(self) -> dict[str, Any] | None:
        """The settings of the latest run that started writing here."""
        starts = [e for e in self.events if e.get("event") == "start"]
        return starts[-1] if starts else None

    def _write(self, doc: dict[str, Any]) -> None:
        if self._fd is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not _ends_with_newline(self.path):
                os.write(fd, b"\n")  # end a torn line so the next record stays readable
            self._fd = fd
        line = json.dumps({**doc, "time": round(time.time(), 3)}, ensure_ascii=False) + "\n"
        os.write(self._fd, line.encode())  # one O_APPEND write per line

    def append(self, record: SampleRecord) -> None:
        """Record a sample's outcome (after its file is final and verified)."""
        self._write(record.to_json())
        self.samples[record.index] = record

    def event(self, name: str, **fields: Any) -> None:
        """Record a run event (``start``, ``end``)."""
        doc = {"event": name, **fields}
        self._write(doc)
        self.events.append(doc)

    def close(self) -> None:
        """Flush the manifest to disk and close it (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.close(fd)


def _ends_with_newline(path: str) -> bool:
    """True for an empty file or one whose last byte is a newline."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return True
        f.seek(size - 1)
        return f.read(1) == b"\n"


class RunLock:
    """An exclusive ``flock`` on ``DIR/.extract.lock``: one extraction per directory.

    Released by ``release`` or, whatever happens, when the process dies.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str) -> RunLock:
        """Take the lock without waiting.

        Raises:
            UsageError: Another run holds it (the message names its pid).
        """
        path = os.path.join(directory, RUN_LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not try_lock_exclusive(fd):
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(
                f"--out {directory}: another extraction is writing there (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
