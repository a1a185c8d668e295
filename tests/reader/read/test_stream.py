"""No head-of-line blocking: complete samples come out while earlier ones are still written.

Writers are real: a separate process holds a sample's lock (``tools/writer.py hold``), or
this process holds one through its own open file description (``WriterLock.create``),
which ``flock`` treats as another owner.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hidden_state_reader import HiddenStateReader, LockTimeoutError
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample

from procs import hold_lock
from samples import make_tensors, write_samples


def release(proc: subprocess.Popen[str]) -> float:
    """Tell a holder to write its sample and release; returns its release time (epoch)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    released = float(proc.stdout.readline().split()[1])
    assert proc.wait(timeout=30) == 0
    return released


class Consumer:
    """Iterates a reader in a thread; hands out (name, monotonic, epoch) per sample."""

    def __init__(self, reader: HiddenStateReader) -> None:
        self.reader = reader
        self.got: queue.Queue[tuple[str, float, float] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None
        self.thread.start()

    def _run(self) -> None:
        try:
            for sample in self.reader:
                self.got.put((os.path.basename(sample.path), time.monotonic(), time.time()))
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.got.put(None)

    def next(self, timeout: float = 30.0) -> tuple[str, float, float]:
        item = self.got.get(timeout=timeout)
        assert item is not None, f"the reader ended early ({self.error!r})"
        return item

    def finish(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the reader did not end"
        if self.error is not None:
            raise self.error


def test_complete_samples_are_yielded_while_an_earlier_one_is_held(hs_dir: Path) -> None:
    holder = hold_lock(hs_dir / "a_0.safetensors")  # scheduled first, written last
    try:
        reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=60, max_samples=6)
        consumer = Consumer(reader)
        latencies = []
        for i in range(5):
            (path,) = write_samples(hs_dir, 1, prefix="b_", start=i)  # tmp + rename
            published = time.monotonic()
            name, yielded, _ = consumer.next()
            assert name == path.name
            latencies.append((yielded - published) * 1000)
        # The real check: all five came out while a_0's writer still held its lock.
        assert holder.poll() is None
        assert reader.pending == ["a_0.safetensors"]
        released = release(holder)
        name, _, woke = consumer.next()
        assert name == "a_0.safetensors"
        consumer.finish()
    finally:
        holder.kill()
        holder.wait()
    print(
        "publication -> yield (ms): "
        + ", ".join(f"{ms:.1f}" for ms in latencies)
        + f"; held sample after release: {(woke - released) * 1000:.1f} ms"
    )
    assert reader.stats.yielded == 6 and reader.stats.lock_timeouts == 0


@pytest.mark.parametrize("watch", ["auto", "poll"])
def test_a_snapshot_yields_in_completion_order(hs_dir: Path, watch: str) -> None:
    holder = hold_lock(hs_dir / "a.safetensors")
    own = WriterLock.create(str(hs_dir / "b.safetensors"))  # this process writes b
    try:
        write_samples(hs_dir, 2, prefix="c_")
        reader = HiddenStateReader(hs_dir, watch=watch, poll_interval=0.05, lock_timeout=60)
        consumer = Consumer(reader)
        assert {consumer.next()[0], consumer.next()[0]} == {"c_0.safetensors", "c_1.safetensors"}
        # b completes before a: published under the lock this process holds, then released.
        write_sample(hs_dir / "b.safetensors", *make_tensors(7), use_lock=False)
        own.release()
        assert consumer.next()[0] == "b.safetensors"
        release(holder)
        assert consumer.next()[0] == "a.safetensors"
        consumer.finish()
    finally:
        own.release()
        holder.kill()
        holder.wait()


def test_lock_timeout_is_per_sample_and_delays_no_other(hs_dir: Path) -> None:
    holder = hold_lock(hs_dir / "a.safetensors")
    own = WriterLock.create(str(hs_dir / "b.safetensors"))
    try:
        write_samples(hs_dir, 3, prefix="c_")
        reader = HiddenStateReader(hs_dir, lock_timeout=0.5)
        timeouts_at_yield = [reader.stats.lock_timeouts for _ in reader]
        assert timeouts_at_yield == [0, 0, 0], "complete samples came before any timeout"
        assert reader.stats.lock_timeouts == 2
        with pytest.raises(LockTimeoutError, match=r"a\.safetensors|b\.safetensors"):
            list(HiddenStateReader(hs_dir, lock_timeout=0.2, on_error="raise"))
    finally:
        own.release()
        holder.kill()
        holder.wait()


class _TimeoutSeen(logging.Handler):
    """Sets an event when the reader reports a lock timeout (its own warning)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "still holds the lock" in record.getMessage():
            self.seen.set()


def test_a_follower_still_yields_a_sample_whose_writer_finishes_after_its_timeout(
    hs_dir: Path,
) -> None:
    holder = hold_lock(hs_dir / "slow.safetensors")
    handler = _TimeoutSeen()
    logger = logging.getLogger("hidden_state_reader.reader")
    logger.addHandler(handler)
    try:
        write_samples(hs_dir, 1, prefix="fast_")
        reader = HiddenStateReader(
            hs_dir, follow=True, idle_timeout=60, lock_timeout=0.2, max_samples=2
        )
        consumer = Consumer(reader)
        assert consumer.next()[0] == "fast_0.safetensors"
        assert handler.seen.wait(30), "the timeout is reported"
        release(holder)
        assert consumer.next()[0] == "slow.safetensors", "and the sample kept in sight"
        consumer.finish()
        assert reader.stats.lock_timeouts == 1
    finally:
        logger.removeHandler(handler)
        holder.kill()
        holder.wait()


def test_idle_timeout_counts_time_in_which_nothing_became_ready(hs_dir: Path) -> None:
    holder = hold_lock(hs_dir / "long.safetensors")
    try:
        write_samples(hs_dir, 1)
        reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=0.5, lock_timeout=60)
        consumer = Consumer(reader)
        assert consumer.next()[0] == "hs_0.safetensors"
        consumer.finish()  # ends although a writer is still at work
        assert reader.pending == ["long.safetensors"]
        assert reader.stats.lock_timeouts == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_held_lock_is_not_polled_while_events_are_received(
    hs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a writer holds its lock, the reader looks at it once, then waits for the
    kernel's events; it does not re-probe it on a timer (counted, not timed)."""
    from hidden_state_reader.files.locks import SharedLock
    from hidden_state_reader.read import directory as directory_backend

    looks: list[str] = []

    class CountingLock(SharedLock):  # the real lock, counted
        @classmethod
        def acquire(cls, data_path: str, **kwargs: Any) -> SharedLock | None:
            looks.append(os.path.basename(data_path))
            return SharedLock.acquire(data_path, **kwargs)

    monkeypatch.setattr(directory_backend, "SharedLock", CountingLock)
    holder = hold_lock(hs_dir / "held.safetensors")
    try:
        # Ends after 1.5 s in which nothing became ready: the whole time a writer held it.
        reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=1.5, lock_timeout=60)
        assert list(reader) == []
        assert reader.pending == ["held.safetensors"]
    finally:
        holder.kill()
        holder.wait()
    assert looks.count("held.safetensors") == 1, looks
