"""Sleep mode: no copy of the connector ever reads a KV cache that vLLM has released.

Sleeping (level 1 or 2) discards the KV cache, where the hidden states of answered
requests wait until the connector has copied them into host memory. The rule: before
the cache is released, every save already ordered has all its copies issued and
completed (a sample whose copies cannot be issued in time fails, with the reason in its
lock); host memory and the writer threads are not touched by sleep, so files finish
while the engine sleeps, and capture simply continues after wake-up (the cache keeps
its addresses).

- vLLM >= 0.33 tells the connector: ``unregister_kv_caches`` runs before the cache is
  released (sleep, discard) and ``restore_kv_caches`` after wake-up.
- vLLM 0.26 - 0.32 do not. There, an engine started with ``enable_sleep_mode`` issues
  every pending copy before each of the connector's engine-thread calls returns, so
  none is left when ``sleep`` (which first synchronises the device) releases the cache.
"""

from __future__ import annotations

import threading
from typing import Any

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.write.pipeline import WritePipeline
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

RELEASE_REASON = "the KV cache was released (sleep) before its hidden states were copied"


class SleepGuard:
    """Drains the connector's device copies where sleep mode needs it.

    Args:
        vllm_config: The engine's configuration (``model_config.enable_sleep_mode``).
        timeout: Seconds a drain may wait for host buffers before failing samples.
        mutex: The worker side's lock (the engine's thread and hand-offs enter there).
    """

    def __init__(self, vllm_config: Any, timeout: float, mutex: threading.RLock) -> None:
        model_config = getattr(vllm_config, "model_config", None)
        self.enabled = bool(getattr(model_config, "enable_sleep_mode", False))
        # Without vLLM's release hooks, drain at every step instead.
        self.every_step = self.enabled and not compat.calls_cache_release_hooks()
        self.timeout = timeout
        self.mutex = mutex
        self.released = False

    def after_call(self, pipeline: WritePipeline | None) -> None:
        """End of an engine-thread call or hand-off: issue every pending copy (old vLLM)."""
        if self.every_step and pipeline is not None:
            pipeline.flush(None, self.timeout, reason=RELEASE_REASON)

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
