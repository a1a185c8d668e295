"""Old home of the lock-wait primitive, kept so that existing imports keep working.

The code lives in ``hidden_state_reader.format.flockwait`` (the format's reader-side
lock is built on it); import from there.
"""

from hidden_state_reader.format.flockwait import (
    WAKE_SIGNAL,
    CancelToken,
    flock_wait,
    install_wake_handler,
    threads_ignore_signals,
)

__all__ = [
    "WAKE_SIGNAL",
    "CancelToken",
    "flock_wait",
    "install_wake_handler",
    "threads_ignore_signals",
]
