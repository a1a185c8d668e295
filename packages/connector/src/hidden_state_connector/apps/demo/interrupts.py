"""Ctrl-C and SIGTERM during the demo: the first stops cleanly, a second exits at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from hidden_state_connector.apps.server import VllmServer
from hidden_state_reader.apps.cli.toolkit import EXIT_INTERRUPTED


class Interrupts:
    """SIGINT/SIGTERM: the first stops cleanly, a second exits at once.

    While ``raising`` is set (model build, server start-up) the first signal raises
    ``KeyboardInterrupt`` so that blocking set-up code unwinds through its clean-up.

    Args:
        stop: Set by the first signal: the producer and the trainer wind down.
    """

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.count = 0
        self.raising = True
        self.server: VllmServer | None = None  # killed by a second signal
        self._previous: dict[signal.Signals, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Handle the signals inside the block (main thread only), then restore."""
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals can only be handled in the main thread; the caller's job
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    @staticmethod
    def say(text: str) -> None:
        """Print a line on stderr from a signal handler."""
        # Straight to fd 2: the interrupted code may be inside a write to sys.stderr, and
        # a buffered stream refuses re-entrant writes.
        with contextlib.suppress(OSError, ValueError):
            prefix = "\n" if sys.stderr.isatty() else ""  # off the in-place progress line
            os.write(sys.stderr.fileno(), (prefix + text + "\n").encode())

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count > 1:
            self.say("hidden-state demo: second interrupt, exiting now")
            if self.server is not None:
                self.server.kill()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        self.stop.set()
        self.say("hidden-state demo: interrupted, stopping cleanly (Ctrl-C again to quit at once)")
        if self.raising:
            raise KeyboardInterrupt
