"""A small client for the OpenAI-compatible completions API, for hidden-state requests.

Sends prompts (text or token ids) with bounded concurrency and retries, and returns, per
prompt, the path the server wrote and what went wrong if anything did.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

Prompt = str | Sequence[int]


@dataclass
class Completion:
    """The outcome of one request.

    Attributes:
        index: Position of the prompt in the input.
        path: ``hidden_states_path`` returned by the server (None on failure, and with
            the Mooncake Store backend, which returns ``hidden_states_key`` instead:
            see ``sample``).
        prompt_tokens: Prompt length the server counted.
        error: Why there is no sample, if there is none.
        params: The full ``kv_transfer_params`` returned.
    """

    index: int
    path: str | None
    prompt_tokens: int = 0
    error: str | None = None
    params: dict[str, Any] | None = None

    @property
    def sample(self) -> str | None:
        """Where the sample is: its file, or its store URL; None if neither.

        ``path`` with the file backend; with the Mooncake Store backend the response's
        ``hidden_states_url`` (``mooncake://MASTER/PREFIX/NAME``).
        """
        return self.path or (self.params or {}).get("hidden_states_url")


def complete(
    base_url: str,
    model: str,
    prompt: Prompt,
    *,
    max_tokens: int = 1,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout: float = 600.0,
    retries: int = 3,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """POST one completion; retry connection errors and 5xx with back-off.

    A retry re-sends a request the server may have computed already (the connection
    broke after it): with ``idempotency_key`` the sample is named by the key, so a
    retry never makes a second one (docs/connector.md, "Retries without duplicates").

    Returns:
        The decoded JSON response.

    Raises:
        RuntimeError: The request failed after all retries (or with a 4xx).
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if idempotency_key is not None:
        kv_transfer_params = {**(kv_transfer_params or {}), "idempotency_key": idempotency_key}
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    data = json.dumps(body).encode()
    delay = 0.5
    for attempt in range(retries + 1):
        request = urllib.request.Request(
            base_url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code < 500 or attempt == retries:
                raise RuntimeError(f"HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if attempt == retries:
                raise RuntimeError(f"request failed: {exc}") from exc
        time.sleep(delay)  # back-off before retrying a failed request
        delay *= 2
    raise AssertionError("unreachable")


def _one(index: int, base_url: str, model: str, prompt: Prompt, **kwargs: Any) -> Completion:
    try:
        result = complete(base_url, model, prompt, **kwargs)
    except RuntimeError as exc:
        return Completion(index, None, error=str(exc))
    params = result.get("kv_transfer_params") or {}
    usage = result.get("usage") or {}
    return Completion(
        index,
        params.get("hidden_states_path"),
        int(usage.get("prompt_tokens", 0)),
        params.get("hidden_states_error"),
        params,
    )


def complete_all(
    base_url: str,
    model: str,
    prompts: Iterable[Prompt],
    *,
    concurrency: int = 8,
    on_done: Callable[[Completion], None] | None = None,
    key_prefix: str | None = None,
    **kwargs: Any,
) -> Iterator[Completion]:
    """Send every prompt with at most ``concurrency`` requests in flight.

    With ``key_prefix``, prompt ``i`` is sent with the idempotency key
    ``f"{key_prefix}-{i}"``: retries, and a re-run of the same job, make no second sample.

    Yields:
        Completions in the order they finish.
    """
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="hs-client") as pool:
        pending: set[Future[Completion]] = set()
        for index, prompt in enumerate(prompts):
            if len(pending) >= concurrency:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from _finish(done, on_done)
            if key_prefix is not None:
                kwargs["idempotency_key"] = f"{key_prefix}-{index}"
            pending.add(pool.submit(_one, index, base_url, model, prompt, **kwargs))
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from _finish(done, on_done)


def _finish(
    done: set[Future[Completion]], on_done: Callable[[Completion], None] | None
) -> Iterator[Completion]:
    for future in done:
        completion = future.result()
        if on_done is not None:
            on_done(completion)
        yield completion
