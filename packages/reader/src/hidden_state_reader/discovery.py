"""Finding samples: a snapshot of a directory, or following it as it grows.

Both sources hand out sample names (``NAME.safetensors``) one at a time, each once,
whether the name was seen through its data file or only through its lock (a lock
without data means "a sample is coming"). ``defer`` puts a name back for a later look.

Following (``FollowSource``) works like ``tail -f`` on a directory:

1. the watcher starts first (watchdog, one observer per process), so nothing created
   during the initial scan is missed;
2. the initial scan lists what is already there, oldest first;
3. file-system events are hints that a name appeared; the names are deduplicated here;
4. a periodic rescan catches whatever the events missed (inotify queue overflow, writes
   from other NFS/Lustre hosts, which inotify never sees). With ``watch="poll"`` there
   is no watcher and the rescan interval is the poll interval.

The per-event cost is a set lookup; only rescans are O(number of files).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from hidden_state_reader.format.names import Kind, classify, natural_key, sample_key
from hidden_state_reader.waiting import CancelToken, threads_ignore_signals

log = logging.getLogger(__name__)

WATCH_MODES = ("auto", "inotify", "poll")
_GONE_MEMORY = 65536  # consumed names remembered to ignore late events (~6 MB at most)
# Longest single sleep while waiting for news. A signal (Ctrl-C) that arrives just before
# the thread goes to sleep does not interrupt that sleep; Python handles it when the sleep
# ends, so this bounds how late a Ctrl-C can be acted on. Idle wake-ups cost nothing.
_MAX_SLEEP = 0.5


def list_samples(root: str) -> list[str]:
    """Names of all samples in ``root`` (data files and pending locks), natural order.

    Args:
        root: The storage directory (not searched recursively).

    Returns:
        Sample names such as ``hs_0.safetensors``, sorted so ``hs_2`` precedes ``hs_10``.
    """
    return sorted(_scan(root), key=natural_key)


def _scan(root: str) -> set[str]:
    names: set[str] = set()
    with os.scandir(root) as entries:
        for entry in entries:
            key = sample_key(entry.name)
            if key is not None:
                names.add(key)
    return names


def _age_key(root: str, name: str) -> tuple[float, tuple[object, ...]]:
    """Order of creation as far as the filesystem tells: lock first, else data mtime."""
    for candidate in (name + ".lock", name):
        try:
            return (os.stat(os.path.join(root, candidate)).st_mtime, natural_key(name))
        except FileNotFoundError:
            continue
    return (float("inf"), natural_key(name))


class _Deferred:
    """Names to look at again later (a min-heap on due time)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._counter = 0

    def push(self, name: str, delay: float) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (time.monotonic() + delay, self._counter, name))

    def pop_due(self) -> str | None:
        if self._heap and self._heap[0][0] <= time.monotonic():
            return heapq.heappop(self._heap)[2]
        return None

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class SnapshotSource:
    """The samples present when iteration starts (plus re-looks at deferred names).

    Args:
        root: Storage directory.
        names: Iterate exactly these names (in this order) instead of scanning.
        cancel: Ends waits for deferred names early.
    """

    def __init__(
        self, root: str, names: Sequence[str] | None = None, cancel: CancelToken | None = None
    ) -> None:
        self.root = root
        self._ready = deque(names if names is not None else list_samples(root))
        self._deferred = _Deferred()
        self._cancel = cancel or CancelToken()

    def next(self, timeout: float | None = None) -> str | None:
        """Next name, or None when nothing is left."""
        if self._ready:
            return self._ready.popleft()
        due = self._deferred.next_due()
        if due is None:
            return None
        self._cancel.sleep(max(0.0, due - time.monotonic()))
        return self._deferred.pop_due()

    def defer(self, name: str, delay: float) -> None:
        """Offer ``name`` again after ``delay`` seconds."""
        self._deferred.push(name, delay)

    def forget(self, name: str) -> None:
        """No-op for snapshots (names are never rediscovered)."""

    def close(self) -> None:
        """Nothing to release."""


RESCAN = ""  # put into a follower's queue: events were lost, rescan now


class _OverflowAlarm(logging.Handler):
    """Turns watchdog's "Inotify queue overflowed" log record into immediate rescans.

    watchdog only logs a queue overflow for non-recursive watches; without this, names
    whose events were dropped would wait for the next periodic rescan.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.sinks: set[queue.SimpleQueue[str | None]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage():
            for sink in list(self.sinks):
                sink.put(RESCAN)


class _Observer:
    """One watchdog observer per process, shared by all followers (inotify is scarce)."""

    _lock = threading.Lock()
    _observer: Any = None
    _pid: int | None = None
    _alarm = _OverflowAlarm()

    @classmethod
    def schedule(cls, root: str, sink: queue.SimpleQueue[str | None]) -> object:
        from watchdog.events import (
            FileCreatedEvent,
            FileMovedEvent,
            FileSystemEvent,
            FileSystemEventHandler,
        )
        from watchdog.observers import Observer

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                # Only appearances matter; deletions and modifications are not news.
                if event.is_directory or event.event_type not in ("created", "moved"):
                    return
                path = getattr(event, "dest_path", "") or event.src_path
                name = os.path.basename(os.fsdecode(path))
                if classify(name) in (Kind.DATA, Kind.LOCK):
                    sink.put(name)

        # watchdog's threads (observer, one emitter per watch) start in here.
        with cls._lock, threads_ignore_signals():
            if cls._observer is None or cls._pid != os.getpid():
                observer = Observer()
                observer.daemon = True
                observer.start()
                cls._observer, cls._pid = observer, os.getpid()
                logging.getLogger("watchdog.observers.inotify_c").addHandler(cls._alarm)
            cls._alarm.sinks.add(sink)
            # Ask the kernel only for creations and renames: every open, write and close in
            # a busy directory would otherwise flood (and overflow) the inotify queue.
            return cls._observer.schedule(
                Handler(), root, recursive=False, event_filter=[FileCreatedEvent, FileMovedEvent]
            )

    @classmethod
    def unschedule(cls, watch: object, sink: queue.SimpleQueue[str | None]) -> None:
        with cls._lock:
            cls._alarm.sinks.discard(sink)
            if cls._observer is not None and cls._pid == os.getpid():
                with contextlib.suppress(KeyError, OSError):
                    cls._observer.unschedule(watch)


class FollowSource:
    """Follows a growing directory; ``next`` blocks until a new sample name appears.

    Args:
        root: Storage directory.
        watch: ``"auto"`` (inotify, falling back to polling), ``"inotify"``, or
            ``"poll"`` (periodic rescans only; use on NFS/Lustre with remote writers).
        rescan_interval: Seconds between safety rescans when a watcher runs.
        poll_interval: Seconds between rescans in ``"poll"`` mode.
    """

    def __init__(
        self,
        root: str,
        *,
        watch: str = "auto",
        rescan_interval: float = 30.0,
        poll_interval: float = 1.0,
    ) -> None:
        if watch not in WATCH_MODES:
            raise ValueError(f"watch must be one of {WATCH_MODES}, got {watch!r}")
        self.root = root
        self._events: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._known: set[str] = set()
        # Names consumed and removed recently: events about them may still be queued
        # (lock created, data renamed) and must not bring them back.
        self._gone: deque[str] = deque()
        self._gone_set: set[str] = set()
        self._ready: deque[str] = deque()
        self._deferred = _Deferred()
        self._closed = False
        self._watch: object | None = None
        if watch != "poll":
            try:
                self._watch = _Observer.schedule(root, self._events)
            except (OSError, ImportError) as exc:
                if watch == "inotify":
                    raise
                log.warning("cannot watch %s (%s); polling every %.1fs", root, exc, poll_interval)
        self._interval = rescan_interval if self._watch is not None else poll_interval
        self._next_rescan = 0.0  # the initial scan happens on the first next()
        self.rescans = 0
        self.overflows = 0

    @property
    def watching(self) -> bool:
        """Whether file-system events are being received (vs. polling)."""
        return self._watch is not None

    def _admit(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._known and name not in self._gone_set:
                self._known.add(name)
                self._ready.append(name)

    def _rescan(self) -> None:
        try:
            present = _scan(self.root)
        except FileNotFoundError:
            present = set()
        # A file that exists again after its name was consumed is news, not an echo.
        for name in present & self._gone_set:
            self._gone_set.discard(name)
        fresh = [n for n in present if n not in self._known]
        fresh.sort(key=lambda n: _age_key(self.root, n))
        self._admit(fresh)
        self.rescans += 1
        self._next_rescan = time.monotonic() + self._interval

    def _drain_events(self) -> None:
        while True:
            try:
                name = self._events.get_nowait()
            except queue.Empty:
                return
            self._note(name)

    def _note(self, name: str | None) -> None:
        if name == RESCAN:
            self._next_rescan = 0.0  # events were lost: look at the directory now
            self.overflows += 1
        elif name is not None:
            key = sample_key(name)
            if key is not None:
                self._admit((key,))

    def next(self, timeout: float | None = None) -> str | None:
        """Block until a new name appears; None when ``timeout`` passes or on close."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._closed:
            name = self._deferred.pop_due()
            if name is not None:
                return name
            if time.monotonic() >= self._next_rescan:
                self._rescan()
            self._drain_events()
            if self._ready:
                return self._ready.popleft()
            now = time.monotonic()
            wake = self._next_rescan
            due = self._deferred.next_due()
            if due is not None:
                wake = min(wake, due)
            if end is not None:
                if now >= end:
                    return None
                wake = min(wake, end)
            try:
                name = self._events.get(timeout=min(_MAX_SLEEP, max(0.0, wake - now)))
            except queue.Empty:
                continue
            self._note(name)
        return None

    def defer(self, name: str, delay: float) -> None:
        """Offer ``name`` again after ``delay`` seconds."""
        self._deferred.push(name, delay)

    def forget(self, name: str) -> None:
        """Drop a name whose files are gone, freeing its memory.

        Late events about it are ignored; a rescan (which sees only files that exist)
        offers it again if a file of that name reappears.
        """
        self._known.discard(name)
        if name not in self._gone_set:
            self._gone.append(name)
            self._gone_set.add(name)
            if len(self._gone) > _GONE_MEMORY:
                self._gone_set.discard(self._gone.popleft())

    def close(self) -> None:
        """Stop watching; a blocked ``next`` returns None."""
        if self._closed:
            return
        self._closed = True
        self._events.put(None)
        if self._watch is not None:
            _Observer.unschedule(self._watch, self._events)
            self._watch = None
