"""One thread that takes each step's rows into the host arena, then starts saves, in order.

The engine's thread only enqueues (``StepTransfer.submit`` and a work item per step); this
thread waits for each step's copy, routes its rows to their requests and positions, and
then starts the saves whose rows are all in: a save is never started before the rows of
every earlier step have landed. Items run strictly in the order they were put.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

_STOP = object()


class IngestThread:
    """A FIFO of work items run on one daemon thread; failures are logged, never raised.

    Args:
        name: Thread name (for stack dumps).
        on_error: Called with the exception of an item that raised.
        on_start: Called first on the thread (per-thread settings).
    """

    def __init__(
        self,
        name: str,
        on_error: Callable[[BaseException], None],
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._queue: queue.Queue[object] = queue.Queue()
        self._on_error = on_error
        self._on_start = on_start
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Callable[[], None]) -> None:
        """Run ``item`` after every item put before it."""
        with self._idle:
            self._pending += 1
        self._queue.put(item)

    def drain(self, timeout: float | None) -> bool:
        """Wait until every item put so far has run; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float | None) -> bool:
        """Run what is queued (bounded by ``timeout``), then end the thread."""
        drained = self.drain(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout=1.0 if not drained else timeout)
        return drained

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # a setting, not the work: log and go on
                log.warning("%s: start-up setting failed: %r", self._thread.name, exc)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                item()  # type: ignore[operator]
            except BaseException as exc:  # the engine must keep running
                self._on_error(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
