"""The producer side of the demo: prompts -> ``vllm serve`` -> hidden-state files."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from hidden_state_connector.client import Completion, complete_all


class Producer:
    """Send prompts to the server from a background thread, with bounded concurrency.

    Every prompt is one completion with ``max_tokens=1``: the server runs the prefill,
    the connector writes the prompt's hidden states, and the response names the file.

    Args:
        base_url: The server's base URL.
        model: The served model name.
        prompts: Texts to send.
        concurrency: Requests in flight at most.
        stop: Set to stop sending (requests in flight still finish).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompts: Sequence[str],
        *,
        concurrency: int,
        stop: threading.Event,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.prompts = list(prompts)
        self.concurrency = concurrency
        self._stop = stop
        self._lock = threading.Lock()
        self.produced = 0
        self.failed = 0
        self.tokens = 0
        self.paths: set[str] = set()
        self.errors: list[str] = []
        self.error: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hs-demo-producer", daemon=True)

    def start(self) -> None:
        """Start sending."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread."""
        self._thread.join(timeout)

    def _record(self, completion: Completion) -> None:
        with self._lock:
            if completion.path is not None and completion.error is None:
                self.produced += 1
                self.tokens += completion.prompt_tokens
                self.paths.add(completion.path)
            else:
                self.failed += 1
                if len(self.errors) < 5:
                    reason = completion.error or "no hidden_states_path in the response"
                    self.errors.append(f"prompt {completion.index}: {reason}")

    def _run(self) -> None:
        self.started_at = time.monotonic()
        try:
            completions = complete_all(
                self.base_url,
                self.model,
                self.prompts,
                concurrency=self.concurrency,
                max_tokens=1,
            )
            try:
                for completion in completions:
                    self._record(completion)
                    if self._stop.is_set():
                        break
            finally:
                # Closing the generator waits for the requests still in flight.
                close = getattr(completions, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # reported by the orchestrator
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.done.set()
