"""Finding samples: a snapshot of a directory, or following it as it grows.

Both sources hand out sample names (``NAME.safetensors``), each once, whether the name
was seen through its data file or only through its lock (a lock without data means "a
sample is coming"), and report which known names were *touched*: a file-system event
said one of its files was created, renamed into place or closed after writing. A
writer releases its lock by closing it, so a touch is how the kernel tells a reader that
a sample it waits for may be complete (``flock`` stays the truth: the reader probes).
``take`` returns both; ``wait`` sleeps until there is something to take.

Following (``FollowSource``) works like ``tail -f`` on a directory:

1. the watcher starts first (inotify, one instance and one thread per process), so
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

import ctypes
import errno
import logging
import os
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

from hidden_state_reader.format.flockwait import threads_ignore_signals
from hidden_state_reader.format.names import (
    DATA_SUFFIX,
    Kind,
    classify,
    lock_path,
    natural_key,
    sample_key,
)

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
    return _entries(root)[0]


def _entries(root: str) -> tuple[set[str], list[str]]:
    """One pass over a directory: sample names (by data or lock file), temp-file names."""
    samples: set[str] = set()
    temps: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            kind = classify(entry.name)
            if kind is Kind.TEMP:
                temps.append(entry.name)
            elif kind is not Kind.OTHER:
                key = sample_key(entry.name)
                assert key is not None
                samples.add(key)
    return samples, temps


def list_entries(root: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """List a storage directory once: sample names and temporary-file names.

    The one directory scan of the package: readers (``list_samples``), ``scan_health``
    and the ``hidden-state`` commands all see a directory through it.

    Args:
        root: The storage directory (not searched recursively; hidden entries such as
            ``.claims`` and ``.quarantine`` are ignored).

    Returns:
        ``(samples, temps)``, both in natural order. A sample appears once whether it
        was seen through its data file, its lock, or both.

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.
    """
    samples, temps = _entries(os.fspath(root))
    return sorted(samples, key=natural_key), sorted(temps, key=natural_key)


def describe_empty(root: str) -> str:
    """Say what a directory without samples holds (for the "no samples" warning).

    Args:
        root: The storage directory.

    Returns:
        One sentence naming the directory, what is in it, and which sub-folders hold
        samples (readers do not descend into them: point a reader at each).
    """
    subdirs: list[str] = []
    others = temps = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(".") and classify(entry.name) is not Kind.TEMP:
                continue  # the readers' own bookkeeping
            if entry.is_dir(follow_symlinks=False):
                if _holds_samples(entry.path):
                    subdirs.append(entry.name)
            elif classify(entry.name) is Kind.TEMP:
                temps += 1
            else:
                others += 1
    what = [f"{others} other file(s)"] if others else []
    if temps:
        what.append(f"{temps} temporary file(s) (writers at work, or died)")
    text = f"no samples (*{DATA_SUFFIX}) found in {root}: " + (", ".join(what) or "it is empty")
    if subdirs:
        shown = ", ".join(sorted(subdirs, key=natural_key)[:5])
        text += (
            f"; samples are in sub-folders ({shown}{', ...' if len(subdirs) > 5 else ''}), "
            "which readers do not search: point the reader at each sub-folder"
        )
    return text


def _holds_samples(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(sample_key(e.name) is not None for e in entries)
    except OSError:
        return False


def _age_key(root: str, name: str) -> tuple[float, tuple[object, ...]]:
    """Order of creation as far as the filesystem tells: lock first, else data mtime."""
    for candidate in (lock_path(name), name):
        try:
            return (os.stat(os.path.join(root, candidate)).st_mtime, natural_key(name))
        except FileNotFoundError:
            continue
    return (float("inf"), natural_key(name))


_EVENTS = ("created", "moved", "closed")
RESCAN = ""  # put into a follower's queue: events were lost, rescan now


_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x8, 0x80, 0x100
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR, _IN_ONLYDIR = 0x4000, 0x8000, 0x40000000, 0x1000000
_IN_CLOEXEC = 0o2000000
# Appearances (created, renamed into place) and closes of files opened for writing (a
# writer releasing its lock). Not opens, reads or plain writes: readers open files
# read-only, so their own activity never comes back as events, and a busy directory does
# not flood the queue.
_MASK = _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name)


_Sink = queue.SimpleQueue[str | None]
_Handle = tuple[int, _Sink]


class _Inotify:
    """One inotify instance and one reader thread per process, shared by all followers.

    The kernel's events go straight from ``read(2)`` to each follower's queue (no
    move-pairing delay, no dispatcher thread in between). inotify instances are scarce
    (128 per user on some machines), so there is one per process, with one watch per
    directory.
    """

    _lock = threading.Lock()
    _fd: int | None = None
    _pid: int | None = None
    _sinks: dict[int, set[_Sink]] = {}

    @classmethod
    def _start(cls) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "inotify_init1"):  # not Linux: the callers fall back to polling
            raise OSError(errno.ENOSYS, "inotify is not available on this system")
        fd = int(libc.inotify_init1(_IN_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        cls._fd, cls._pid, cls._sinks = fd, os.getpid(), {}
        thread = threading.Thread(target=cls._run, args=(fd,), name="hidden-state-inotify")
        thread.daemon = True
        with threads_ignore_signals():
            thread.start()
        return fd

    @classmethod
    def schedule(cls, root: str, sink: _Sink) -> _Handle:
        """Watch ``root``; its events go to ``sink``. Returns the handle for ``unschedule``."""
        with cls._lock:
            fd = cls._fd if cls._fd is not None and cls._pid == os.getpid() else cls._start()
            libc = ctypes.CDLL(None, use_errno=True)
            wd = int(libc.inotify_add_watch(fd, os.fsencode(root), _MASK))
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot watch {root}: {os.strerror(err)}")
            cls._sinks.setdefault(wd, set()).add(sink)
            return wd, sink

    @classmethod
    def unschedule(cls, handle: _Handle) -> None:
        """Stop delivering to a sink; the watch goes when its last sink does."""
        wd, sink = handle
        with cls._lock:
            if cls._pid != os.getpid() or cls._fd is None:
                return
            sinks = cls._sinks.get(wd)
            if sinks is None:
                return
            sinks.discard(sink)
            if not sinks:
                del cls._sinks[wd]
                ctypes.CDLL(None, use_errno=True).inotify_rm_watch(cls._fd, wd)

    @classmethod
    def _run(cls, fd: int) -> None:
        while True:
            try:
                buf = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError as exc:
                log.warning("inotify reader stopped: %s", exc)
                return
            cls._dispatch(buf)

    @classmethod
    def _dispatch(cls, buf: bytes) -> None:
        offset = 0
        with cls._lock:
            while offset + _EVENT.size <= len(buf):
                wd, mask, _, length = _EVENT.unpack_from(buf, offset)
                raw = buf[offset + _EVENT.size : offset + _EVENT.size + length]
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    for sinks in cls._sinks.values():
                        for sink in sinks:
                            sink.put(RESCAN)  # events were lost: rescan now
                    continue
                if mask & _IN_IGNORED:
                    cls._sinks.pop(wd, None)  # the directory is gone
                    continue
                if mask & _IN_ISDIR or not length:
                    continue
                name = os.fsdecode(raw.rstrip(b"\0"))
                if classify(name) in (Kind.DATA, Kind.LOCK):
                    for sink in cls._sinks.get(wd, ()):
                        sink.put(name)


class _EventSource:
    """What both sources share: the event queue, the watch, touched names, closing."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._events: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._watch: _Handle | None = None
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
            self._watch = _Inotify.schedule(self.root, self._events)
        except OSError as exc:
            if watch == "inotify":
                raise
            log.warning("cannot watch %s (%s); polling every %.1fs", self.root, exc, poll_interval)
            return False
        return True

    def take(self) -> tuple[list[str], set[str]]:
        """New names (in order of appearance) and known names touched since the last call."""
        self._drain_events()
        fresh, touched = list(self._fresh), self._touched
        self._fresh.clear()
        self._touched = set()
        return fresh, touched

    def _has_news(self) -> bool:
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
            _Inotify.unschedule(self._watch)
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
            if self._has_news() or (until is not None and now >= until):
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

    def _admit(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._known:
                self._touched.add(name)
            elif name not in self._gone_set:
                self._known.add(name)
                self._fresh.append(name)

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
            if self._has_news() or (until is not None and now >= until):
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
