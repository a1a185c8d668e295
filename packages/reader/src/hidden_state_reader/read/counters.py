"""Counters a reader keeps, so skipped samples are never silent."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class ReaderStats:
    """What a reader did. Every sample it did not yield is counted under a reason.

    Attributes:
        yielded: Samples handed to the caller.
        bytes: Tensor bytes handed to the caller.
        tokens: Tokens handed to the caller.
        incomplete: Truncated files (a writer died mid-write).
        corrupt: Files that are not valid samples.
        failed: Samples their writer reported as failed in the lock file.
        stale_locks: Lock files whose writer is gone and whose data never appeared.
        lock_timeouts: Samples still locked when ``lock_timeout`` ran out.
        vanished: Names that disappeared before they could be read (consumed elsewhere).
        claimed_elsewhere: Samples another reader of the group had claimed.
        done_elsewhere: Samples another reader of the group had already consumed.
        owned_elsewhere: Samples another member of the group owned and took (following
            with claims: this reader only looked, once, when its turn came).
        reclaimed: Samples taken over from a reader that died.
        empty: Valid files with zero tokens (skipped: nothing to train on).
        quarantined: Rejected files moved to ``.quarantine/``.
    """

    yielded: int = 0
    bytes: int = 0
    tokens: int = 0
    incomplete: int = 0
    corrupt: int = 0
    failed: int = 0
    stale_locks: int = 0
    lock_timeouts: int = 0
    vanished: int = 0
    claimed_elsewhere: int = 0
    done_elsewhere: int = 0
    owned_elsewhere: int = 0
    reclaimed: int = 0
    empty: int = 0
    quarantined: int = 0

    @property
    def skipped(self) -> int:
        """Samples rejected as unusable."""
        return self.incomplete + self.corrupt + self.failed + self.stale_locks + self.empty

    def as_dict(self) -> dict[str, int]:
        """Plain dict, for logging or JSON (with the ``skipped`` total)."""
        return {**asdict(self), "skipped": self.skipped}

    def merge(self, other: ReaderStats) -> None:
        """Add another reader's counters to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class WatchCounters:
    """What a following reader's directory watch has done so far (a snapshot).

    Attributes:
        rescans: Full listings of the directory (the first scan, safety rescans, polls).
        overflows: inotify queue overflows (each one answered by a rescan).
        tracked: Sample names the watch knows (its memory grows with this).
    """

    rescans: int
    overflows: int
    tracked: int
