"""Same-process delivery of save orders, for engines that take no further step.

A save order queued in ``request_finished`` normally reaches the worker in the next
engine step's metadata. An in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
stops stepping as soon as its outputs are done, so that step may never come. When the
worker half lives in the same process as the scheduler half (one GPU or CPU worker:
vLLM's ``UniProcExecutor``, in-process and multiprocess engines alike), the scheduler
hands the order over directly instead. Workers in other processes (tensor parallel,
``MultiprocExecutor``) register nothing here, and orders take the metadata path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hidden_state_connector.engine.metadata import SaveOrder

Accept = Callable[[SaveOrder], None]

_lock = threading.Lock()
_workers: dict[str, Accept] = {}


def register(key: str, accept: Accept) -> None:
    """Offer this process's writing worker for the engine ``key``."""
    with _lock:
        _workers[key] = accept


def unregister(key: str, accept: Accept) -> None:
    """Withdraw a worker (at its shutdown); a newer registration is left alone."""
    with _lock:
        if _workers.get(key) == accept:
            del _workers[key]


def find(key: str) -> Accept | None:
    """The writing worker of engine ``key`` in this process, if there is one."""
    with _lock:
        return _workers.get(key)
