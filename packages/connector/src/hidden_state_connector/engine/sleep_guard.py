"""Sleep mode: no copy of the connector ever reads a KV cache that vLLM has released.

Sleeping (level 1 or 2) discards the KV cache, where the hidden states of answered
requests wait until the connector has copied them into host memory. The connector keeps
a finished request's blocks until its copies have completed, and vLLM's pause before
sleep waits for those blocks (0.26 - 0.34: ``has_finished_requests`` counts requests
whose blocks a connector holds; a multiprocess engine steps until they are freed, an
in-process one refuses to reset its cache, "Failed to reset KV cache", and releases
nothing). On top of that, vLLM >= 0.33 calls ``unregister_kv_caches`` right before it
releases the cache (sleep, discard) and ``restore_kv_caches`` after wake-up: there every
copy still pending is issued and awaited, and a sample whose copies cannot be issued in
time fails with the reason in its lock. Host memory and the writer threads are not
touched by sleep, so files finish while the engine sleeps; capture continues after
wake-up (the cache keeps its addresses).
"""

from __future__ import annotations

import threading

from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

RELEASE_REASON = "the KV cache was released (sleep) before its hidden states were copied"


class SleepGuard:
    """Drains the connector's device copies before vLLM releases the cache.

    Args:
        timeout: Seconds a drain may wait for host buffers before failing samples.
        mutex: The worker side's lock (the engine's thread and hand-offs enter there).
    """

    def __init__(self, timeout: float, mutex: threading.RLock) -> None:
        self.timeout = timeout
        self.mutex = mutex
        self.released = False

    def before_release(self, pipeline: WritePipeline | None) -> None:
        """Before vLLM releases the cache: finish every copy in flight, then return."""
        if pipeline is None:
            return
        with self.mutex:
            pipeline.flush(None, self.timeout, reason=RELEASE_REASON)
            pipeline.extractor.wait_copies()
            self.released = True
        log.info("HiddenStateConnector: copies drained; the KV cache may be released")

    def after_restore(self) -> None:
        """The cache is back (same addresses): capture continues."""
        if self.released:
            log.info("HiddenStateConnector: KV cache restored; capturing again")
        self.released = False
