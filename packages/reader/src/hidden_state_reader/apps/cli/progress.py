"""The one progress reporter of both packages' commands: ``ProgressReporter``.

Used by ``ls``, ``stats``, ``verify``, ``export``, ``extract`` and ``demo``. Each command
decides what its line says and when it is worth a line (every 1000 files, every second,
a new snapshot); the reporter decides how it is shown: redrawn in place on a terminal,
one line each otherwise, never interleaved with a message.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from hidden_state_reader.apps.cli.toolkit import isatty


class ProgressReporter:
    """Shows a progress line on ``stream``, at most every ``interval`` seconds.

    Args:
        stream: Where the line goes (default ``sys.stderr``).
        interval: Minimum seconds between two lines shown by ``update`` (0: no limit).
        inline: Redraw the line in place; default: when ``stream`` is a terminal.
        enabled: Show anything at all (``--progress``, a terminal).
        clock: Time source (tests).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        interval: float = 0.0,
        inline: bool | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.inline = isatty(self.stream) if inline is None else inline
        self.enabled = enabled
        self.clock = clock
        self.shown = 0  # lines shown so far
        self._last = -math.inf
        self._dirty = False  # an in-place line is on screen, not yet ended

    def update(self, text: str | Callable[[], str], *, force: bool = False) -> bool:
        """Show ``text`` (or what it returns) if ``interval`` has passed, or ``force``.

        Returns:
            Whether a line was shown.
        """
        now = self.clock()
        if not self.enabled or (not force and now - self._last < self.interval):
            return False
        self._last = now
        self.show(text() if callable(text) else text)
        return True

    def show(self, text: str) -> None:
        """Show ``text`` now, whatever the interval."""
        if not self.enabled:
            return
        if self.inline:
            self.stream.write("\r\x1b[K" + text)
            self._dirty = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown += 1

    def break_line(self) -> None:
        """End an in-place line before other output (a log message, the summary)."""
        if self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False

    def message(self, text: str) -> None:
        """Print ``text`` on a line of its own without breaking the progress line."""
        self.break_line()
        self.stream.write(text + "\n")
        self.stream.flush()
