"""Same-process delivery of save orders, for engines that take no further step.

A save order queued in ``request_finished`` normally reaches the worker in the next
engine step's metadata. An in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
stops stepping as soon as its outputs are done, so that step may never come. When the
worker half lives in the same process as the scheduler half (one GPU or CPU worker:
vLLM's ``UniProcExecutor``, in-process and multiprocess engines alike), the scheduler
hands the order over directly instead. Workers in other processes (tensor parallel,
``MultiprocExecutor``) register nothing here, and orders take the metadata path.

The same worker also answers which of its samples already failed, so a request whose
save was ordered before it finished (a prompt-only capture that kept decoding) can tell
its client in the response (``known_failure``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hidden_state_connector.engine.metadata import SaveOrder

Accept = Callable[[SaveOrder], None]
FailureLookup = Callable[[str], "str | None"]

_lock = threading.Lock()
_workers: dict[str, Accept] = {}
_failures: dict[str, FailureLookup] = {}


def register(key: str, accept: Accept, failure_of: FailureLookup | None = None) -> None:
    """Offer this process's writing worker for the engine ``key``.

    Args:
        key: The engine's key (``compat.engine_key``).
        accept: Starts a save order.
        failure_of: Why a request's sample failed, if it already did (else None).
    """
    with _lock:
        _workers[key] = accept
        if failure_of is not None:
            _failures[key] = failure_of


def unregister(key: str, accept: Accept) -> None:
    """Withdraw a worker (at its shutdown); a newer registration is left alone."""
    with _lock:
        if _workers.get(key) == accept:
            del _workers[key]
            _failures.pop(key, None)


def known_failure(key: str, req_id: str) -> str | None:
    """Why ``req_id``'s sample failed, if a worker of engine ``key`` in this process knows."""
    with _lock:
        lookup = _failures.get(key)
    return None if lookup is None else lookup(req_id)


def find(key: str) -> Accept | None:
    """The writing worker of engine ``key`` in this process, if there is one."""
    with _lock:
        return _workers.get(key)
