"""Finish-time save orders (``engine/handoff/``) over a real abstract Unix socket."""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from hidden_state_connector.engine.handoff import socket_channel
from hidden_state_connector.engine.handoff.socket_channel import OrderListener, OrderSender
from hidden_state_connector.engine.metadata import SaveOrder

WAIT_S = 10.0  # generous bound for anything a thread must do


class _Inbox:
    """``accept`` of an ``OrderListener``: collects orders, wakes waiters."""

    def __init__(self) -> None:
        self.orders: list[SaveOrder] = []
        self._cond = threading.Condition()

    def __call__(self, order: SaveOrder) -> None:
        with self._cond:
            self.orders.append(order)
            self._cond.notify_all()

    def wait_for(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.orders) >= count, WAIT_S)


def _order(req_id: str) -> SaveOrder:
    return SaveOrder(req_id, f"/data/{req_id}.safetensors", [1, 2, 3], [7, 4], 2, None, False)


@pytest.fixture
def engine_key() -> str:
    return f"unit-{uuid.uuid4().hex}/0"


def test_order_channel_round_trip(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    sender = OrderSender(engine_key)
    try:
        sent = [_order("a"), SaveOrder("b", "/data/b.safetensors", [], [], 0, "aborted", True)]
        assert all(sender.send(o) for o in sent)
        assert inbox.wait_for(2)
        assert inbox.orders == sent  # one connection: in order, fields intact
    finally:
        sender.close()
        listener.close()


def test_order_channel_refuses_clients_without_the_engine_key(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    address = socket_channel._address(engine_key)
    try:
        with pytest.raises(AuthenticationError):
            Client(address, "AF_UNIX", authkey=b"not the engine's key")
        # A raw client that skips the handshake and writes a framed order at once.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(address)
        payload = b'{"req_id":"evil","path":"/x.safetensors","token_ids":[1],"block_ids":[0],'
        payload += b'"num_prompt_tokens":1}'
        raw.sendall(struct.pack("!i", len(payload)) + payload)
        # Connections are accepted one after the other: once a real sender's order has
        # arrived, the two refused clients have been dealt with.
        sender = OrderSender(engine_key)
        assert sender.send(_order("good"))
        assert inbox.wait_for(1)
        assert [o.req_id for o in inbox.orders] == ["good"]
        sender.close()
        raw.close()
    finally:
        listener.close()


def test_order_sender_returns_false_when_nobody_listens(engine_key: str) -> None:
    sender = OrderSender(engine_key)
    assert sender.send(_order("a")) is False
    assert sender.send(_order("b")) is False  # and again, without retrying the socket


def test_order_sender_returns_false_after_the_listener_closed(engine_key: str) -> None:
    inbox = _Inbox()
    listener = OrderListener(engine_key, inbox)
    listener.close()
    sender = OrderSender(engine_key)
    try:
        delivered = sender.send(_order("late"))
        accepted = inbox.wait_for(1) if delivered else False
        assert not delivered, f"sent after close; handed to accept() after close: {accepted}"
        assert inbox.orders == []
    finally:
        sender.close()
