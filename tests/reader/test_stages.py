"""Producers on threads feeding a bounded queue (``hidden_state_reader/stages.py``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest

from hidden_state_reader.stages import Stage, Stages, StageStoppedError


def test_items_arrive_in_order_then_the_producers_error() -> None:
    def produce() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("disk gone")

    stage = Stage(produce, capacity=1, name="t-stage")
    got = []
    with pytest.raises(ValueError, match="disk gone"):
        for item in stage:
            got.append(item)
    assert got == [1, 2]
    assert stage.close() == []


def test_the_queue_is_bounded_and_close_hands_back_what_was_never_taken() -> None:
    blocked = threading.Event()
    closed_on: list[str] = []

    def produce() -> Iterator[int]:
        try:
            for i in itertools.count():
                if i == 3:
                    blocked.set()  # three queued: this one waits for room
                yield i
        finally:
            closed_on.append(threading.current_thread().name)

    stage = Stage(produce, capacity=3, name="t-bounded")
    assert blocked.wait(10)
    # The item made while the queue was full is queued when the stage stops.
    assert stage.close() == [0, 1, 2, 3]
    assert closed_on == ["t-bounded"]  # the generator was closed on its own thread


def test_room_waits_for_the_budget_and_ends_when_stopped() -> None:
    third = threading.Event()
    interrupted = []

    def produce() -> Iterator[str]:
        for i in itertools.count():
            if i == 2:
                third.set()
            stage.room()
            yield f"sample {i}"

    stage: Stage[str] = Stage(
        produce,
        capacity=100,
        name="t-room",
        budget=2,
        weight=lambda item: 1,
        interrupt=lambda: interrupted.append(True),
        start=False,
    )
    stage.start()
    assert third.wait(10)
    assert stage.close() == ["sample 0", "sample 1"]  # two ahead at most
    assert interrupted == [True]
    with pytest.raises(StageStoppedError):
        stage.room()


def test_in_order_takes_one_item_from_each_producer_in_turn() -> None:
    def producer(tag: str, n: int) -> Iterator[str]:
        return (f"{tag}{i}" for i in range(n))

    stages = Stages(
        [lambda: producer("a", 3), lambda: producer("b", 1), lambda: producer("c", 2)],
        capacity=1,
        name="t-order",
        in_order=True,
    )
    assert list(stages) == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert stages.close() == []
    mixed = Stages(
        [lambda: producer("a", 3), lambda: producer("b", 2)],
        capacity=2,
        name="t-mixed",
        in_order=False,
    )
    got = list(mixed)
    assert sorted(got) == ["a0", "a1", "a2", "b0", "b1"]
    assert [g for g in got if g[0] == "a"] == ["a0", "a1", "a2"]  # each in its order
