"""One live progress line on stderr: what was produced, consumed, how fast, the loss."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TextIO

from hidden_state_reader.apps.cli.progress import ProgressReporter
from hidden_state_reader.apps.cli.toolkit import format_rate

MB = 1e6


@dataclass(frozen=True)
class Snapshot:
    """Counters at one moment.

    Attributes:
        time: ``time.monotonic()`` when taken.
        produced: Samples the server reported written.
        failed: Requests without a sample.
        consumed: Samples the training loop received.
        tokens_produced: Prompt tokens of the produced samples.
        tokens_consumed: Tokens of the consumed samples.
        bytes_per_token: Tensor bytes per token of a sample (what the server writes).
        bytes_read: Tensor bytes of the consumed samples.
        loss: Recent loss on unseen data.
        total: Prompts to send.
    """

    time: float
    produced: int
    failed: int
    consumed: int
    tokens_produced: int
    tokens_consumed: int
    bytes_per_token: float
    bytes_read: int
    loss: float | None
    total: int


class SnapshotLine:
    """Shows a snapshot through a ``ProgressReporter`` at most every ``interval`` seconds.

    The interval is measured in snapshot time. Rates are over the interval since the
    previous line.

    Args:
        stream: Where to print (stderr).
        interval: Minimum seconds between updates (at least 1).
    """

    def __init__(self, stream: TextIO, interval: float = 1.0) -> None:
        self.reporter = ProgressReporter(stream)
        self.interval = max(1.0, interval)
        self._last: Snapshot | None = None
        self._start: float | None = None
        self._printed = False

    def update(self, snap: Snapshot, *, force: bool = False) -> None:
        """Print ``snap`` if ``interval`` has passed since the last line.

        The first call only sets the baseline of the rates. ``force`` prints now, unless
        nothing changed since the last line.
        """
        last = self._last
        if last is None:
            self._start = snap.time
            self._last = snap
            if not force:
                return
            last = Snapshot(snap.time, 0, 0, 0, 0, 0, 0.0, 0, None, snap.total)
        elif force:
            if self._printed and replace(snap, time=0.0) == replace(last, time=0.0):
                return
        elif snap.time - last.time < self.interval:
            return
        self._last = snap
        self._printed = True
        assert self._start is not None
        dt = max(snap.time - last.time, 1e-9)
        written = (snap.tokens_produced - last.tokens_produced) * snap.bytes_per_token
        loss = "-" if snap.loss is None else f"{snap.loss:.3f}"
        failed = f" ({snap.failed} failed)" if snap.failed else ""
        text = (
            f"[{snap.time - self._start:6.1f}s] produced {snap.produced}/{snap.total}{failed}"
            f"  consumed {snap.consumed}"
            f"  {format_rate((snap.tokens_produced - last.tokens_produced) / dt, 'tok/s')}"
            f"  write {written / dt / MB:.2f} MB/s"
            f"  read {(snap.bytes_read - last.bytes_read) / dt / MB:.2f} MB/s"
            f"  loss {loss}"
        )
        self.reporter.show(text)

    def finish(self) -> None:
        """End the in-place line (terminal only)."""
        self.reporter.break_line()

    def message(self, text: str) -> None:
        """Print a message on its own line without breaking the progress line."""
        self.reporter.message(text)
