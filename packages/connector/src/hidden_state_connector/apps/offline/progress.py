"""The progress line (samples, tokens and bytes per second, ETA) and the final throughput."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from hidden_state_reader.apps.cli.progress import ProgressReporter
from hidden_state_reader.apps.cli.toolkit import format_si


def format_duration(seconds: float) -> str:
    """``75`` -> ``"1m15s"``; ``4000`` -> ``"1h06m"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ExtractCounters:
    """Counts outcomes; its line goes through a ``ProgressReporter`` at most every ``interval``.

    Rates count only samples computed by vLLM in this run, over the time since the engine
    became ready (model loading is not throughput); samples found already written count
    as done but not in the rates.

    Args:
        total: Samples this run has to handle.
        stream: Where the line goes (stderr). On a terminal it is redrawn in place.
        interval: Minimum seconds between two lines.
        clock: Time source (tests).
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.interval = interval
        self.clock = clock
        self.ok = 0
        self.failed = 0
        self.recovered = 0  # ok samples whose files were already there
        self.computed = 0  # ok samples written by vLLM in this run
        self.tokens = 0
        self.bytes = 0
        self.started = clock()
        self.engine_ready: float | None = None
        self.engine_done: float | None = None
        self.reporter = ProgressReporter(self.stream, interval=interval, clock=clock)

    @property
    def done(self) -> int:
        """Samples handled so far (ok or failed)."""
        return self.ok + self.failed

    def mark_engine_ready(self) -> None:
        """Start the throughput clock (vLLM is loaded)."""
        if self.engine_ready is None:
            self.engine_ready = self.clock()

    def mark_engine_done(self) -> None:
        """Stop the throughput clock (the last computed sample is recorded); idempotent."""
        if self.engine_ready is not None and self.engine_done is None:
            self.engine_done = self.clock()

    def add_ok(self, tokens: int, nbytes: int, *, computed: bool) -> None:
        """Count an ok sample (``computed`` False when its file was already there)."""
        self.ok += 1
        if computed:
            self.computed += 1
            self.tokens += tokens
            self.bytes += nbytes
        else:
            self.recovered += 1

    def add_failed(self) -> None:
        """Count a failed sample."""
        self.failed += 1

    @property
    def engine_seconds(self) -> float:
        """Seconds of throughput time so far."""
        if self.engine_ready is None:
            return 0.0
        end = self.engine_done if self.engine_done is not None else self.clock()
        return max(end - self.engine_ready, 1e-9)

    def rates(self) -> tuple[float, float, float]:
        """``(samples/s, tokens/s, bytes/s)`` of computed samples."""
        seconds = self.engine_seconds
        if not seconds:
            return 0.0, 0.0, 0.0
        return self.computed / seconds, self.tokens / seconds, self.bytes / seconds

    def eta(self) -> float:
        """Seconds left at the current rate (inf when unknown)."""
        samples_per_s = self.rates()[0]
        left = max(self.total - self.done, 0)
        if not left:
            return 0.0
        return left / samples_per_s if samples_per_s > 0 else math.inf

    def line(self) -> str:
        """The progress line."""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        parts = [f"extract: {self.done:,}/{self.total:,} ({pct:.1f}%)"]
        if self.failed:
            parts[0] += f", {self.failed:,} failed"
        if self.engine_ready is not None:
            sps, tps, bps = self.rates()
            parts.append(f"{sps:.1f} samples/s, {format_si(tps)} tok/s, {bps / 1e6:.1f} MB/s")
            parts.append(f"ETA {format_duration(self.eta())}")
        else:
            parts.append("loading")
        return " | ".join(parts)

    def maybe_print(self, *, force: bool = False) -> None:
        """Print the line if ``interval`` has passed since the last one (or ``force``)."""
        self.reporter.update(self.line, force=force)

    def finish(self) -> None:
        """Print the final line and end it."""
        self.maybe_print(force=True)
        self.break_line()

    def break_line(self) -> None:
        """End an in-place line before other output (a log message, the summary)."""
        self.reporter.break_line()
