"""The kernel's file-system events for the readers: inotify through ``ctypes``.

``Inotify`` keeps one inotify instance and one reader thread per process, shared by every
directory a reader follows or watches (``read.sources``). Each watch delivers the names of
sample and lock files that appeared in its directory (created, renamed into place) or
were closed after writing (a writer releasing its lock) to a queue; nothing else, so a
busy directory does not flood the queue and readers never see their own reads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
import time
from typing import Protocol

from hidden_state_reader.files.flockwait import threads_ignore_signals
from hidden_state_reader.format.names import Kind, classify
from hidden_state_reader.probes import INOTIFY_EVENT, probes

log = logging.getLogger(__name__)

RESCAN = ""
"""Put into every sink when the kernel dropped events (``IN_Q_OVERFLOW``): rescan now."""


IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100
"""Event masks a ``probes.INOTIFY_EVENT`` callback may test."""
_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR, _IN_ONLYDIR = 0x4000, 0x8000, 0x40000000, 0x1000000
_IN_CLOEXEC = 0o2000000
# Appearances (created, renamed into place) and closes of files opened for writing (a
# writer releasing its lock). Not opens, reads or plain writes: readers open files
# read-only, so their own activity never comes back as events, and a busy directory does
# not flood the queue.
_MASK = _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name)


class Sink(Protocol):
    """Where a watch delivers: file names that appeared or were closed, ``RESCAN``, None.

    A ``queue.SimpleQueue``, or anything with its ``put``.
    """

    def put(self, item: str | None) -> None:
        """Deliver one item (called on the inotify thread: must not block)."""
        ...


Handle = tuple[int, Sink]
"""A watch, as ``Inotify.schedule`` returns it for ``unschedule``."""


class Inotify:
    """One inotify instance and one reader thread per process, shared by all followers.

    The kernel's events go straight from ``read(2)`` to each follower's queue (no
    move-pairing delay, no dispatcher thread in between). inotify instances are scarce
    (128 per user on some machines), so there is one per process, with one watch per
    directory.
    """

    _lock = threading.Lock()
    _fd: int | None = None
    _pid: int | None = None
    _sinks: dict[int, set[Sink]] = {}

    @classmethod
    def _start(cls) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "inotify_init1"):  # not Linux: the callers fall back to polling
            raise OSError(errno.ENOSYS, "inotify is not available on this system")
        fd = int(libc.inotify_init1(_IN_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        cls._fd, cls._pid, cls._sinks, cls._windows = fd, os.getpid(), {}, {}
        cls._batch_window = 0.0
        thread = threading.Thread(target=cls._run, args=(fd,), name="hidden-state-inotify")
        thread.daemon = True
        with threads_ignore_signals():
            thread.start()
        return fd

    @classmethod
    def schedule(cls, root: str, sink: Sink) -> Handle:
        """Watch ``root``; its events go to ``sink``. Returns the handle for ``unschedule``."""
        with cls._lock:
            fd = cls._fd if cls._fd is not None and cls._pid == os.getpid() else cls._start()
            libc = ctypes.CDLL(None, use_errno=True)
            wd = int(libc.inotify_add_watch(fd, os.fsencode(root), _MASK))
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot watch {root}: {os.strerror(err)}")
            cls._sinks.setdefault(wd, set()).add(sink)
            cls._batch_window = cls._shortest_window()  # a new watch starts without one
            return wd, sink

    @classmethod
    def unschedule(cls, handle: Handle) -> None:
        """Stop delivering to a sink; the watch goes when its last sink does."""
        wd, sink = handle
        with cls._lock:
            if cls._pid != os.getpid() or cls._fd is None:
                return
            cls._windows.pop(handle, None)
            sinks = cls._sinks.get(wd)
            if sinks is not None:
                sinks.discard(sink)
                if not sinks:
                    del cls._sinks[wd]
                    ctypes.CDLL(None, use_errno=True).inotify_rm_watch(cls._fd, wd)
            cls._batch_window = cls._shortest_window()

    _windows: dict[Handle, float] = {}
    _batch_window = 0.0  # the smallest window of the live watches: the reader thread's

    @classmethod
    def set_batch_window(cls, handle: Handle, seconds: float) -> None:
        """Let the events of one watch gather up to ``seconds`` (0: deliver each at once).

        A follower in a consumer group sets its own watch's window: every member's watch
        receives every sample's events, most about samples other members own, and a
        thread woken once per window instead of once per event costs a fraction of the
        CPU. Each watch keeps its own window: the shared reader thread waits only as long
        as the most impatient live watch allows, so a watch's events are never held
        longer than its window (a watch with 0 gets each event at once).
        """
        with cls._lock:
            if handle[0] in cls._sinks and handle[1] in cls._sinks[handle[0]]:
                cls._windows[handle] = max(0.0, float(seconds))
            cls._batch_window = cls._shortest_window()

    @classmethod
    def batch_window(cls, handle: Handle) -> float:
        """The window of one watch (0 unless ``set_batch_window`` was called for it)."""
        with cls._lock:
            return cls._windows.get(handle, 0.0)

    @classmethod
    def _shortest_window(cls) -> float:
        """The reader thread's wait between reads: 0 if any live watch has no window."""
        live = [(wd, sink) for wd, sinks in cls._sinks.items() for sink in sinks]
        return min((cls._windows.get(h, 0.0) for h in live), default=0.0)

    @classmethod
    def _run(cls, fd: int) -> None:
        while True:
            window = cls._batch_window
            if window:
                time.sleep(window)  # let the events of this window gather: one read
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
        observers = probes(INOTIFY_EVENT)
        now = time.time_ns() if observers else 0
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
                    cls._batch_window = cls._shortest_window()
                    continue
                if mask & _IN_ISDIR or not length:
                    continue
                name = os.fsdecode(raw.rstrip(b"\0"))
                for observe in observers:
                    observe(name=name, mask=mask, time_ns=now)
                if classify(name) in (Kind.DATA, Kind.LOCK):
                    for sink in cls._sinks.get(wd, ()):
                        sink.put(name)
