"""Per-sample stage timestamps, for finding where a sample's time goes (off by default).

Set ``HIDDEN_STATE_CONNECTOR_TRACE=/path/file.jsonl`` in the engine's environment and
every sample the write pipeline finishes appends one JSON line: the request id, the
path, the outcome and ``CLOCK_MONOTONIC`` seconds (one clock for every process on the host, so a
client can compare them with its own) at each stage:

- ``submitted``: the save entered the pipeline (engine's thread).
- ``copies_issued``: every chunk's gather was issued (all slabs obtained).
- ``copies_done``: the writer thread saw the last chunk's copy complete.
- ``released``: the file was published and its lock released (or failed).
"""

from __future__ import annotations

import json
import os
import threading
import time

TRACE_ENV = "HIDDEN_STATE_CONNECTOR_TRACE"


class StageTrace:
    """Appends one line per finished sample to the file named by ``TRACE_ENV``, if set."""

    def __init__(self) -> None:
        path = os.environ.get(TRACE_ENV)
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether stage times are recorded at all (callers skip the clock reads if not)."""
        return self._file is not None

    @staticmethod
    def now() -> float:
        """The trace clock."""
        return time.monotonic()

    def mark(self, stages: dict[str, float], stage: str) -> None:
        """Note the time ``stage`` was reached in a sample's ``stages`` (no-op when off)."""
        if self._file is not None:
            stages[stage] = self.now()

    def record(self, req_id: str, path: str, outcome: str, stages: dict[str, float]) -> None:
        """Write one sample's line (no-op when tracing is off)."""
        if self._file is None:
            return
        line = json.dumps({"req_id": req_id, "path": path, "outcome": outcome, **stages})
        with self._lock:
            self._file.write(line + "\n")
