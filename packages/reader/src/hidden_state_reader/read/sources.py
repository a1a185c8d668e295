"""Finding samples: a snapshot of a directory, or following it as it grows.

Both sources hand out sample names (``NAME.safetensors``), each once, whether the name
was seen through its data file or only through its lock (a lock without data means "a
sample is coming"), and report which known names were *touched*: a file-system event
said one of its files was created, renamed into place or closed after writing. A
writer releases its lock by closing it, so a touch is how the kernel tells a reader that
a sample it waits for may be complete (``flock`` stays the truth: the reader probes).
``take`` returns both; ``wait`` sleeps until there is something to take.

Following (``FollowSource``) works like ``tail -f`` on a directory:

1. the watcher starts first (``inotify``: one instance and one thread per process), so
   nothing created during the initial scan is missed;
2. the initial scan lists what is already there, oldest first;
3. file-system events are hints that a name appeared (or was touched); the names are
   deduplicated here;
4. a periodic rescan catches whatever the events missed (inotify queue overflow, writes
   from other NFS/Lustre hosts, which inotify never sees). With ``watch="poll"`` there
   is no watcher and the rescan interval is the poll interval.

The per-event cost is a set lookup; only rescans are O(number of files).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from hidden_state_reader.files.inotify import RESCAN, Handle, Inotify
from hidden_state_reader.files.listing import list_samples, scan_samples
from hidden_state_reader.format.names import lock_path, natural_key, sample_key
from hidden_state_reader.options import WATCH_MODES

log = logging.getLogger(__name__)

_GONE_MEMORY = 65536  # consumed names remembered to ignore late events (~6 MB at most)
# Longest single sleep while waiting for news. A signal (Ctrl-C) that arrives just before
# the thread goes to sleep does not interrupt that sleep; Python handles it when the sleep
# ends, so this bounds how late a Ctrl-C can be acted on. Idle wake-ups cost nothing.
_MAX_SLEEP = 0.5


def _age_key(root: str, name: str) -> tuple[float, tuple[object, ...]]:
    """Order of creation as far as the filesystem tells: lock first, else data mtime."""
    for candidate in (lock_path(name), name):
        try:
            return (os.stat(os.path.join(root, candidate)).st_mtime, natural_key(name))
        except FileNotFoundError:
            continue
    return (float("inf"), natural_key(name))


class _Admitting:
    """The sink a watch delivers to: passes on only names ``admits`` accepts.

    Runs on the inotify thread: an event about a name no one here cares for (a sample
    another member of the group owns) is dropped there, so it costs this reader no
    wake-up of its consumer.
    """

    def __init__(self, events: queue.SimpleQueue[str | None]) -> None:
        self.events = events
        self.admits: Callable[[str], bool] | None = None

    def put(self, name: str | None) -> None:
        admits = self.admits
        if admits is None or name is None or name == RESCAN or admits(name):
            self.events.put(name)


class _EventSource:
    """What both sources share: the event queue, the watch, touched names, closing."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._events: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._sink = _Admitting(self._events)
        self._watch: Handle | None = None
        self._fresh: deque[str] = deque()
        self._touched: set[str] = set()
        self._closed = False

    @property
    def watching(self) -> bool:
        """Whether file-system events are being received (vs. polling)."""
        return self._watch is not None

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def _start_watch(self, watch: str, poll_interval: float) -> bool:
        try:
            self._watch = Inotify.schedule(self.root, self._sink)
        except OSError as exc:
            if watch == "inotify":
                raise
            log.warning("cannot watch %s (%s); polling every %.1fs", self.root, exc, poll_interval)
            return False
        return True

    def set_batch_window(self, seconds: float) -> None:
        """Let this source's events gather up to ``seconds`` (``Inotify.set_batch_window``).

        This watch's own setting: other sources in the process keep theirs.
        """
        if self._watch is not None:
            Inotify.set_batch_window(self._watch, seconds)

    def take(self) -> tuple[list[str], set[str]]:
        """New names (in order of appearance) and known names touched since the last call."""
        if self._events.empty() and not self._fresh and not self._touched:
            return [], set()  # the common case while reading: asked after every sample
        self._drain_events()
        fresh, touched = list(self._fresh), self._touched
        self._fresh.clear()
        self._touched = set()
        return fresh, touched

    def has_news(self) -> bool:
        """Whether there are new or touched names to take."""
        return bool(self._fresh or self._touched)

    def _drain_events(self) -> None:
        while True:
            try:
                name = self._events.get_nowait()
            except queue.Empty:
                return
            self._note(name)

    def _note(self, name: str | None) -> None:
        raise NotImplementedError

    def forget(self, name: str) -> None:
        """Drop a name whose files are gone (a snapshot never offers a name twice)."""

    def _sleep(self, now: float, wake: float) -> None:
        """Sleep until an event arrives or ``wake`` (at most ``_MAX_SLEEP`` at a time)."""
        try:
            name = self._events.get(timeout=min(_MAX_SLEEP, max(0.0, wake - now)))
        except queue.Empty:
            return
        self._note(name)

    def close(self) -> None:
        """Stop watching; a ``wait`` in progress returns."""
        if self._closed:
            return
        self._closed = True
        self._events.put(None)
        if self._watch is not None:
            Inotify.unschedule(self._watch)
            self._watch = None


class SnapshotSource(_EventSource):
    """The samples present when iteration starts; touches once ``watch`` was called.

    Args:
        root: Storage directory.
        names: Offer exactly these names (in this order) instead of scanning.
        watch: ``"auto"``, ``"inotify"`` or ``"poll"`` (``watch()`` then does nothing).
    """

    def __init__(
        self, root: str, names: Sequence[str] | None = None, *, watch: str = "auto"
    ) -> None:
        super().__init__(root)
        if watch not in WATCH_MODES:
            raise ValueError(f"watch must be one of {WATCH_MODES}, got {watch!r}")
        self._mode = watch
        listed = list(names) if names is not None else list_samples(root)
        self._fresh.extend(listed)
        self._names = set(listed)

    def watch(self) -> bool:
        """Start receiving touches (the reader waits for several writers); True if on."""
        if self._watch is None and self._mode != "poll" and not self._closed:
            self._start_watch(self._mode, 0.0)
            self._mode = "poll" if self._watch is None else self._mode
        return self._watch is not None

    def _note(self, name: str | None) -> None:
        if name is None or name == RESCAN:
            return
        key = sample_key(name)
        if key in self._names:
            self._touched.add(key)

    def wait(self, until: float | None) -> None:
        """Sleep until a touch arrives, ``until`` (monotonic time) passes, or ``close``."""
        while not self._closed:
            self._drain_events()
            now = time.monotonic()
            if self.has_news() or (until is not None and now >= until):
                return
            self._sleep(now, now + _MAX_SLEEP if until is None else until)


class FollowSource(_EventSource):
    """Follows a growing directory: new names and touches as they happen.

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
        super().__init__(root)
        self._known: set[str] = set()
        # Names consumed and removed recently: events about them may still be queued
        # (lock created, data renamed) and must not bring them back.
        self._gone: deque[str] = deque()
        self._gone_set: set[str] = set()
        if watch != "poll":
            self._start_watch(watch, poll_interval)
        self._interval = rescan_interval if self._watch is not None else poll_interval
        self._next_rescan = 0.0  # the initial scan happens on the first wait/take
        self.rescans = 0
        self.overflows = 0

    @property
    def tracked(self) -> int:
        """Names the source knows (its memory grows with this)."""
        return len(self._known)

    def _admit(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._known:
                self._touched.add(name)
            elif name not in self._gone_set:
                self._known.add(name)
                self._fresh.append(name)

    def _rescan(self) -> None:
        try:
            present = scan_samples(self.root)
        except FileNotFoundError:
            present = set()
        # A file that exists again after its name was consumed is news, not an echo.
        for name in present & self._gone_set:
            self._gone_set.discard(name)
        fresh = [n for n in present if n not in self._known]
        fresh.sort(key=lambda n: _age_key(self.root, n))
        self._admit(fresh)
        # A rescan also stands in for events that were lost or never come (other NFS
        # hosts): every known name present is looked at again if it is awaited.
        self._touched |= present & self._known
        self.rescans += 1
        self._next_rescan = time.monotonic() + self._interval

    def _note(self, name: str | None) -> None:
        if name == RESCAN:
            self._next_rescan = 0.0  # events were lost: look at the directory now
            self.overflows += 1
        elif name is not None:
            key = sample_key(name)
            if key is not None:
                self._admit((key,))

    def take(self) -> tuple[list[str], set[str]]:
        """New names (in order of appearance) and known names touched since the last call."""
        if time.monotonic() >= self._next_rescan:
            self._rescan()
        return super().take()

    def wait(self, until: float | None) -> None:
        """Sleep until there is news, ``until`` (monotonic time) passes, or ``close``."""
        while not self._closed:
            if time.monotonic() >= self._next_rescan:
                self._rescan()
            self._drain_events()
            now = time.monotonic()
            if self.has_news() or (until is not None and now >= until):
                return
            self._sleep(now, self._next_rescan if until is None else min(until, self._next_rescan))

    def next(self, timeout: float | None = None) -> str | None:
        """The next new name, or None when ``timeout`` passes or on close (touches dropped)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._closed:
            fresh, _ = self.take()
            if fresh:
                self._fresh.extendleft(reversed(fresh[1:]))
                return fresh[0]
            if end is not None and time.monotonic() >= end:
                return None
            self.wait(end)
        return None

    def only_events_for(self, wanted: Callable[[str], bool]) -> None:
        """Take events only for names already known or that ``wanted`` accepts.

        ``wanted`` runs on the inotify thread (it must not block). Names it turns away
        are still found by the rescans.
        """
        known = self._known

        def admits(file_name: str) -> bool:
            key = sample_key(file_name)
            return key is not None and (key in known or wanted(key))

        self._sink.admits = admits

    def present(self) -> list[str]:
        """Every sample name on disk now (one scan; new ones become known), oldest first."""
        try:
            names = scan_samples(self.root)
        except FileNotFoundError:
            return []
        self._gone_set -= names  # a file there again is news
        self._known |= names
        return sorted(names, key=lambda n: _age_key(self.root, n))

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
