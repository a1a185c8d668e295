"""A forked child never frees what CUDA made: the parent collects its garbage before each fork.

A forked child cannot use CUDA, yet freeing some objects calls it: a page-locked buffer
that a copy read, a device tensor marked with ``record_stream``, a CUDA event. Freed in a
child (a DataLoader worker whose garbage collector frees the reference cycles it
inherited), that call fails inside a destructor and the child aborts ("CUDA error:
initialization error", from ``ExchangeDevice``; reproduced on an H100). A child frees
only what was already garbage when it was forked, so the parent collects first: after
``collect_before_fork`` every ``os.fork`` of this process runs ``gc.collect()`` in the
parent just before it (installed by the device feed, not on import).
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_installed = False


def collect_before_fork() -> None:
    """From now on, collect this process's garbage before each ``os.fork`` (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            os.register_at_fork(before=gc.collect)
            _installed = True
