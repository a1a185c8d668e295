"""Counters of the write path: files, bytes, failures, queue depth, write time.

Totals feed the periodic log line; the deltas since the last call feed vLLM's
KV-connector metrics (``get_kv_connector_stats``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from hidden_state_connector.logs import get_logger

log = get_logger("hidden_state_connector")

_RECENT_FAILURES = 4096  # reasons remembered for responses (``recent_failure``)


@dataclass
class Counters:
    """One set of counters (totals or an interval)."""

    files: int = 0
    bytes: int = 0
    failures: int = 0
    dropped: int = 0
    refused_paths: int = 0
    write_seconds: float = 0.0
    max_queue: int = 0

    def add(self, other: Counters) -> None:
        """Accumulate ``other`` into these counters."""
        self.files += other.files
        self.bytes += other.bytes
        self.failures += other.failures
        self.dropped += other.dropped
        self.refused_paths += other.refused_paths
        self.write_seconds += other.write_seconds
        self.max_queue = max(self.max_queue, other.max_queue)


class WriteStats:
    """Thread-safe counters shared by the connector and its writer threads.

    Args:
        log_interval: Seconds between progress log lines; 0 disables them.
    """

    def __init__(self, log_interval: float = 30.0) -> None:
        self._lock = threading.Lock()
        self.total = Counters()
        self._interval = Counters()
        self._log_interval = log_interval
        self._last_log = time.monotonic()
        self._bytes_at_last_log = 0
        self._recent: OrderedDict[str, str] = OrderedDict()

    def written(self, nbytes: int, seconds: float) -> None:
        """A sample was published."""
        with self._lock:
            for c in (self.total, self._interval):
                c.files += 1
                c.bytes += nbytes
                c.write_seconds += seconds

    def failure(self, req_id: str, path: str, reason: str, *, dropped: bool = False) -> None:
        """A sample was not written; logs one line naming the request."""
        with self._lock:
            for c in (self.total, self._interval):
                c.failures += 1
                c.dropped += int(dropped)
            self._recent[req_id] = reason
            if len(self._recent) > _RECENT_FAILURES:
                self._recent.popitem(last=False)
        log.error("hidden states of request %s not written (%s): %s", req_id, path, reason)

    def recent_failure(self, req_id: str) -> str | None:
        """Why ``req_id``'s sample failed, if it did among the last few thousand failures."""
        with self._lock:
            return self._recent.get(req_id)

    def refused_path(self) -> None:
        """A client-supplied path was refused."""
        with self._lock:
            self.total.refused_paths += 1
            self._interval.refused_paths += 1

    def queued(self, depth: int) -> None:
        """Record the current number of samples in flight."""
        with self._lock:
            self.total.max_queue = max(self.total.max_queue, depth)
            self._interval.max_queue = max(self._interval.max_queue, depth)

    def take_interval(self) -> dict[str, float]:
        """Counters since the previous call, as a plain dict; resets them."""
        with self._lock:
            data, self._interval = asdict(self._interval), Counters()
        return data

    def maybe_log(self, queue_depth: int) -> None:
        """Emit a progress line if the log interval has passed."""
        if not self._log_interval:
            return
        now = time.monotonic()
        if now - self._last_log < self._log_interval:
            return
        with self._lock:
            total = Counters(**asdict(self.total))
        rate = (total.bytes - self._bytes_at_last_log) / (now - self._last_log)
        self._last_log, self._bytes_at_last_log = now, total.bytes
        log.info(
            "hidden states: %d files, %.2f GB written (%.1f MB/s), %d failed, %d in flight",
            total.files,
            total.bytes / 1e9,
            rate / 1e6,
            total.failures,
            queue_depth,
        )
