"""Save orders from the scheduler process to a writing worker in another process, at once.

A save that can only be ordered when its request finishes (stored generated tokens) would
otherwise travel in the next engine step's metadata; an in-process ``LLM`` whose executor
runs workers in their own processes (tensor parallel, vLLM CPU's ``MultiprocExecutor``)
takes no further step once its outputs are done, and at shutdown vLLM stops the workers
before the scheduler. So the writing worker (TP rank 0) listens on an abstract Unix
socket named after its engine, and the scheduler half sends each finish-time order there
as soon as ``request_finished`` makes it. Where the socket cannot be reached (a worker on
another host), orders fall back to the step metadata.

Messages are JSON (never pickle), and connections are authenticated with the engine id
(``multiprocessing.connection``'s HMAC challenge), so no other process can make the
worker write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Client, Connection, Listener

from hidden_state_connector.engine.metadata import SaveOrder
from hidden_state_connector.logs import get_logger
from hidden_state_reader.files.flockwait import threads_ignore_signals

log = get_logger(__name__)

RETRY_AFTER_S = 5.0  # after a failed connect, use the metadata path for this long


def _address(engine_key: str) -> str:
    digest = hashlib.sha256(engine_key.encode()).hexdigest()[:24]
    return f"\0hidden-state-connector-{digest}"


def _authkey(engine_key: str) -> bytes:
    return hashlib.sha256(b"hidden-state-connector/" + engine_key.encode()).digest()


class OrderListener:
    """The writing worker's end: hands every order received to ``accept``.

    Args:
        engine_key: ``compat.engine_key`` of the engine (both halves derive it alike).
        accept: Called from the listener's threads with each ``SaveOrder``.
    """

    def __init__(self, engine_key: str, accept: Callable[[SaveOrder], None]) -> None:
        self._accept = accept
        self._key = engine_key
        self._listener = Listener(_address(engine_key), "AF_UNIX", authkey=_authkey(engine_key))
        self._closing = threading.Event()
        self._receivers: list[threading.Thread] = []
        self._server = threading.Thread(target=self._serve, name="hidden-state-orders", daemon=True)
        with threads_ignore_signals():
            self._server.start()

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except Exception as exc:  # closed, or a client that failed authentication
                if not self._closing.is_set():
                    log.warning("HiddenStateConnector: order channel refused a client: %s", exc)
                    self._closing.wait(0.1)  # back off: a persistent error must not spin
                continue
            if self._closing.is_set():  # a connection that arrived during close()
                conn.close()
                return
            thread = threading.Thread(
                target=self._receive, args=(conn,), name="hidden-state-orders-in", daemon=True
            )
            with threads_ignore_signals():
                thread.start()
            self._receivers.append(thread)

    def _receive(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    # Wakes now and then to see whether shutdown wants the queue drained.
                    if not conn.poll(0.2):
                        if self._closing.is_set():
                            return  # nothing left in the socket: every order is handed over
                        continue
                    message = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    order = SaveOrder(**json.loads(message))
                except (TypeError, ValueError) as exc:
                    log.error("HiddenStateConnector: unreadable save order dropped: %s", exc)
                    continue
                self._accept(order)

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening, after handing over every order already sent (bounded wait)."""
        self._closing.set()
        # Closing a listening socket does not wake a thread blocked in accept(): connect
        # once, so the serving thread sees the flag and stops listening for good.
        # A bare connection that hangs up at once: never blocks close() (a full client
        # handshake could wait for a serving thread busy elsewhere).
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.settimeout(1.0)
            wake.connect(_address(self._key))
        deadline = time.monotonic() + timeout
        self._server.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for thread in self._receivers:
            thread.join(max(0.0, deadline - time.monotonic()))


class OrderSender:
    """The scheduler's end: ``send`` returns False when the order must take the metadata."""

    def __init__(self, engine_key: str) -> None:
        self._key = engine_key
        self._conn: Connection | None = None
        self._retry_at = 0.0

    def send(self, order: SaveOrder) -> bool:
        """Deliver ``order`` to the writing worker now; False if it cannot be reached."""
        if self._conn is None:
            if time.monotonic() < self._retry_at:
                return False
            try:
                self._conn = Client(_address(self._key), "AF_UNIX", authkey=_authkey(self._key))
            except (OSError, EOFError) as exc:
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                log.debug("no order channel (%s); save orders go in the step metadata", exc)
                return False
        try:
            self._conn.send_bytes(json.dumps(asdict(order)).encode())
            return True
        except OSError:
            self.close()
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            return False

    def close(self) -> None:
        """Drop the connection (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
