"""Probes: named points where both libraries tell registered callbacks what happened.

The documented seam for benchmarks and profilers, instead of replacing a library
attribute: ``remove = add_probe(LOCK_ACQUIRE, callback)`` ... ``remove()``. A point
without a callback costs one dict lookup. Callbacks run on the library's own thread
(the inotify thread, the reader's, a writer thread) and get keyword arguments only:
keep them short, and never raise from one.

Points and the arguments their callbacks get (times from ``time.monotonic()`` unless
said otherwise):

- ``INOTIFY_EVENT``: an inotify event on a sample's data or lock file was read:
  ``name`` (the file name), ``mask`` (``files.inotify.IN_CLOSE_WRITE``, ``IN_MOVED_TO``,
  ...), ``time_ns`` (``time.time_ns()`` when the batch of events was read).
- ``LOCK_ACQUIRE``: a reader took a sample's shared lock: ``path`` (the data file),
  ``began`` and ``acquired``.
- ``STORE_PUT``: the connector published a staged file into the store: ``staged``
  (the staged file), ``began`` and ``ended``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

INOTIFY_EVENT = "inotify.event"
LOCK_ACQUIRE = "reader.lock_acquire"
STORE_PUT = "connector.store_put"
POINTS = (INOTIFY_EVENT, LOCK_ACQUIRE, STORE_PUT)

Probe = Callable[..., None]

_probes: dict[str, tuple[Probe, ...]] = {}
_lock = threading.Lock()


def add_probe(point: str, callback: Probe) -> Callable[[], None]:
    """Call ``callback(**details)`` each time ``point`` is reached, until removed.

    Args:
        point: One of ``POINTS``.
        callback: Takes the point's keyword arguments (module docstring).

    Returns:
        A function that removes this callback again.

    Raises:
        ValueError: ``point`` is not one of ``POINTS``.
    """
    if point not in POINTS:
        raise ValueError(f"unknown probe point {point!r} (known: {', '.join(POINTS)})")
    with _lock:
        _probes[point] = (*_probes.get(point, ()), callback)

    def remove() -> None:
        with _lock:
            left = tuple(c for c in _probes.get(point, ()) if c is not callback)
            _probes[point] = left

    return remove


def probes(point: str) -> tuple[Probe, ...]:
    """The callbacks registered at ``point`` (empty when none: the fast path)."""
    return _probes.get(point, ())
