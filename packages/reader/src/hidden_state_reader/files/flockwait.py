"""Blocking ``flock`` with a deadline and cancellation, without polling.

The kernel puts a thread that calls ``flock(LOCK_SH)`` on a file locked ``LOCK_EX`` to
sleep and wakes it the moment the writer releases (or dies). The only way to make such
a sleep end early is a signal, so a wait with a deadline works like this:

* the waiting thread calls libc's ``flock`` through ctypes (Python's own
  ``fcntl.flock`` retries after ``EINTR`` and would sleep on);
* a short-lived timer thread sends a real-time signal (``WAKE_SIGNAL``) to that thread
  when the deadline passes, or when ``CancelToken.cancel()`` is called; the no-op
  handler installed for it makes ``flock`` return ``EINTR`` instead of restarting;
* the timer thread ends with the wait and no descriptor is created: nothing is left.

Importing this module changes nothing in the process. The handler is installed on first
need, and only the main thread can install one: by the first wait that blocks on the main
thread (also in ``DataLoader`` worker processes), or earlier by ``install_wake_handler()``,
which ``HiddenStateReader`` calls when it is built (usually on the main thread), so that
waits on its helper threads can use it. A blocking wait on another thread before that, or
in an application that owns the signal, falls back to short non-blocking retries with
exponential back-off (and tries the installation again at its next wait on the main
thread).

It is part of the format because ``lockfile.SharedLock`` is built on it (needs only
``errors``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from hidden_state_reader.errors import WaitCancelledError

log = logging.getLogger(__name__)

WAKE_SIGNAL: int = int(os.environ.get("HIDDEN_STATE_WAKE_SIGNAL", int(signal.SIGRTMAX) - 4))
"""Real-time signal used to interrupt a blocked ``flock``; override with the
``HIDDEN_STATE_WAKE_SIGNAL`` environment variable if your application uses it."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc_flock = _libc.flock
_libc_flock.argtypes = [ctypes.c_int, ctypes.c_int]
_libc_flock.restype = ctypes.c_int

# After the deadline, re-send the wake signal this often until the waiter notices: a
# signal that lands just before the thread enters flock() is otherwise lost.
_RESEND_INTERVAL = 0.002
_POLL_MIN, _POLL_MAX = 0.0005, 0.05


def _on_wake(signum: int, frame: FrameType | None) -> None:
    """No-op: the signal's only job is to make a blocking system call return EINTR."""


# Serialises the check-then-install below; the set remembers the signals whose owner is
# the application, so that its warning is logged once, not at every wait.
_install_lock = threading.Lock()
_foreign: set[int] = set()


def install_wake_handler() -> bool:
    """Install the no-op handler for ``WAKE_SIGNAL`` if possible (idempotent, thread-safe).

    Only the main thread can install it; call this from there when the process's lock
    waits will all run on other threads (a wait on the main thread installs it itself).

    Returns:
        True if blocking waits with deadlines are available in this process.
    """
    if signal.getsignal(WAKE_SIGNAL) is _on_wake:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    with _install_lock:
        current = signal.getsignal(WAKE_SIGNAL)
        if current is _on_wake:
            return True
        if current not in (signal.SIG_DFL, None):
            if WAKE_SIGNAL not in _foreign:
                _foreign.add(WAKE_SIGNAL)
                log.warning(
                    "signal %d already has a handler; lock waits fall back to short retries "
                    "(set HIDDEN_STATE_WAKE_SIGNAL to a free real-time signal)",
                    WAKE_SIGNAL,
                )
            return False
        signal.signal(WAKE_SIGNAL, _on_wake)
        return True


# Signals a user sends to the whole process. A thread started inside
# ``threads_ignore_signals()`` keeps them blocked, so the kernel hands them to the main
# thread: delivered to a helper thread, a Ctrl-C would leave the main thread asleep in
# its wait until that wait ended by itself.
_PROCESS_SIGNALS = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
    }
)


@contextlib.contextmanager
def threads_ignore_signals() -> Iterator[None]:
    """Start threads in this block with the process's signals blocked (they inherit it).

    The calling thread's own signal mask is restored on exit.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _PROCESS_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _wake_available() -> bool:
    # An uninstalled real-time signal would kill the process: check before every use.
    return signal.getsignal(WAKE_SIGNAL) is _on_wake


class CancelToken:
    """Cancels blocking waits from another thread (used by ``close()``)."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()
        # The event's state as a plain attribute: readers ask after every sample.
        self._set = False
        self._lock = threading.Lock()
        self._waiters: set[_Waiter] = set()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._set

    def cancel(self) -> None:
        """Make every current and future wait with this token raise WaitCancelledError."""
        self._set = True
        self._cancelled.set()
        with self._lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.interrupt_until_done()

    def sleep(self, seconds: float) -> None:
        """Sleep, returning early (with WaitCancelledError) if cancelled."""
        if self._cancelled.wait(seconds):
            raise WaitCancelledError("wait cancelled")

    def _add(self, waiter: _Waiter) -> None:
        with self._lock:
            self._waiters.add(waiter)

    def _remove(self, waiter: _Waiter) -> None:
        with self._lock:
            self._waiters.discard(waiter)


class _Waiter:
    """One thread sleeping in flock(); knows how to interrupt it."""

    def __init__(self) -> None:
        self.thread_id = threading.get_ident()
        self.done = threading.Event()

    def interrupt_until_done(self, limit: float = 5.0) -> None:
        end = time.monotonic() + limit
        while not self.done.is_set() and time.monotonic() < end:
            if not _wake_available():
                return
            try:
                signal.pthread_kill(self.thread_id, WAKE_SIGNAL)
            except ProcessLookupError:
                return
            self.done.wait(_RESEND_INTERVAL)


class _DeadlineTimer(threading.Thread):
    """Interrupts one waiter when its deadline passes; exits when the wait ends."""

    def __init__(self, waiter: _Waiter, deadline: float) -> None:
        super().__init__(name="hidden-state-lock-deadline", daemon=True)
        self._waiter = waiter
        self._deadline = deadline

    def run(self) -> None:
        remaining = self._deadline - time.monotonic()
        if self._waiter.done.wait(max(0.0, remaining)):
            return
        self._waiter.interrupt_until_done(limit=float("inf"))


def _try_lock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def flock_wait(
    fd: int,
    *,
    exclusive: bool = False,
    timeout: float | None = None,
    cancel: CancelToken | None = None,
) -> bool:
    """Take a shared (or exclusive) ``flock`` on ``fd``, sleeping until it is free.

    Args:
        fd: An open file descriptor.
        exclusive: Take ``LOCK_EX`` instead of ``LOCK_SH``.
        timeout: Give up after this many seconds; None waits as long as it takes.
        cancel: A token whose ``cancel()`` ends the wait from another thread.

    Returns:
        True if the lock is now held, False if the timeout ran out.

    Raises:
        WaitCancelledError: ``cancel.cancel()`` was called.
        OSError: ``flock`` failed for another reason (e.g. ENOLCK on a filesystem
            without lock support).
    """
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if cancel is not None and cancel.cancelled:
        raise WaitCancelledError("wait cancelled")
    if _try_lock(fd, op):
        return True
    if timeout is not None and timeout <= 0:
        return False
    deadline = None if timeout is None else time.monotonic() + timeout
    if not install_wake_handler():
        return _wait_by_retrying(fd, op, deadline, cancel)

    waiter = _Waiter()
    timer = _DeadlineTimer(waiter, deadline) if deadline is not None else None
    if cancel is not None:
        cancel._add(waiter)
    try:
        if timer is not None:
            with threads_ignore_signals():
                timer.start()
        while True:
            if cancel is not None and cancel.cancelled:
                raise WaitCancelledError("wait cancelled")
            if _libc_flock(fd, op) == 0:
                return True
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))
            if deadline is not None and time.monotonic() >= deadline:
                return False
            # Any other signal (e.g. SIGINT) is handled by Python between iterations.
    finally:
        waiter.done.set()
        if cancel is not None:
            cancel._remove(waiter)
        if timer is not None:
            timer.join()


def _wait_by_retrying(fd: int, op: int, deadline: float | None, cancel: CancelToken | None) -> bool:
    """Fallback when no wake signal is available: non-blocking tries with back-off."""
    delay = _POLL_MIN
    while True:
        if _try_lock(fd, op):
            return True
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        step = delay if deadline is None else min(delay, deadline - now)
        if cancel is not None:
            cancel.sleep(step)
        else:
            time.sleep(step)
        delay = min(delay * 2, _POLL_MAX)
