"""Lock libraries: ``filelock`` (which the project card names) vs the reader's own locks.

The format's lock protocol (``files/locks.py``, docs/format.md): the writer holds
``flock(LOCK_EX)`` on ``NAME.safetensors.lock`` (created already locked, its status
written inside) until the data file has its final name; readers sleep in
``flock(LOCK_SH)``, which the kernel wakes the moment the writer's descriptor closes,
and several readers hold it at once. This measures, against a writer that holds the
raw ``flock`` (``WriterLock``, as the connector does):

* wake-up: the writer releases; how long until each lock is held by the waiting reader
  (``SharedLock.acquire`` vs ``filelock.FileLock.acquire``, which retries
  ``LOCK_EX | LOCK_NB`` every ``poll_interval``, 0.05 s by default);
* sharing: a second reader while one holds the lock;
* ``filelock.ReadWriteLock`` (its reader-writer lock) on the same lock file.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Context, fmt, log, median, rotate, table

NAME = "locks"
TITLE = "14. Lock libraries: filelock vs the reader's SharedLock"


def _shared_lock(data: str) -> Callable[[], Any]:
    from hidden_state_reader.files.locks import SharedLock

    def acquire() -> Any:
        return SharedLock.acquire(data)

    return acquire


def _filelock(data: str) -> Callable[[], Any]:
    import filelock

    def acquire() -> Any:
        lock = filelock.FileLock(data + ".lock", thread_local=False)
        lock.acquire()
        return lock

    return acquire


def _wake_ms(data: str, acquire: Callable[[], Any], rounds: int) -> list[float]:
    """Milliseconds from the writer's release to the reader (main thread) holding the lock."""
    from hidden_state_reader.files.locks import WriterLock

    out = []
    for i in range(rounds):
        writer = WriterLock.create(data)
        released: list[float] = []

        def release(
            delay: float = 0.02 + (i % 7) * 0.005, lock: Any = writer, at: list = released
        ) -> None:
            time.sleep(delay)  # the reader is asleep in its wait by now
            at.append(time.monotonic())
            lock.release()

        thread = threading.Thread(target=release)
        thread.start()
        held = acquire()
        out.append((time.monotonic() - released[0]) * 1e3)
        held.release()
        thread.join()
    return out


def _observations(data: str) -> dict[str, str]:
    import filelock

    from hidden_state_reader.files.locks import SharedLock, WriterLock

    said = {}
    writer = WriterLock.create(data)
    try:
        filelock.FileLock(data + ".lock").acquire(timeout=0.1)
        said["FileLock while the writer holds LOCK_EX"] = "acquired (no exclusion!)"
    except filelock.Timeout:
        said["FileLock while the writer holds LOCK_EX"] = "waits (it is LOCK_EX too)"
    try:
        with filelock.ReadWriteLock(data + ".lock").read_lock(timeout=0.1):
            said["ReadWriteLock.read_lock on the lock file"] = "acquired"
    except Exception as exc:  # what a user would see is the point
        said["ReadWriteLock.read_lock on the lock file"] = f"{type(exc).__name__}: {exc}"
    writer.release()
    first = filelock.FileLock(data + ".lock", thread_local=False)
    first.acquire()
    try:
        filelock.FileLock(data + ".lock", is_singleton=False).acquire(timeout=0.1)
        said["second FileLock reader while one holds it"] = "acquired"
    except filelock.Timeout:
        said["second FileLock reader while one holds it"] = "waits: no shared mode"
    first.release()
    with SharedLock.acquire(data), SharedLock.acquire(data) as second:
        said["second SharedLock reader while one holds it"] = (
            "acquired at once (LOCK_SH)" if second and second.existed else "?"
        )
    return said


def run(ctx: Context) -> dict[str, Any]:
    rounds = ctx.pick(10, 40)
    root = ctx.workdir(NAME)
    data = str(root / "hs_0.safetensors")
    makers = {"SharedLock": _shared_lock, "filelock.FileLock": _filelock}
    wake: dict[str, list[float]] = {n: [] for n in makers}
    for r in range(2):  # two halves, the order swapped in the second
        for name in rotate(list(makers), r):
            wake[name] += _wake_ms(data, makers[name](data), rounds // 2)
    rows = {n: {"p50_ms": median(v), "max_ms": max(v), "n": len(v)} for n, v in wake.items()}
    log(f"{NAME}: wake-up p50 " + ", ".join(f"{n} {r['p50_ms']:.2f} ms" for n, r in rows.items()))
    import filelock

    return {
        "setup": {"rounds": rounds, "filelock": filelock.__version__},
        "wake": rows,
        "observed": _observations(data),
        "goals": [],
    }


def findings(res: dict[str, Any]) -> list[str]:
    w = res["wake"]
    return [
        f"Locks: a reader waiting with `filelock.FileLock` holds the lock "
        f"{fmt(w['filelock.FileLock']['p50_ms'])} ms (p50) after the writer releases it, "
        f"against {fmt(w['SharedLock']['p50_ms'])} ms for the reader's blocking "
        "`flock(LOCK_SH)`; FileLock has no shared mode (readers would queue behind each "
        "other) and its ReadWriteLock is a SQLite database, not a lock a raw-flock writer "
        "takes, so filelock is not used."
    ]


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    return "\n".join(
        [
            f"filelock {s['filelock']}; {s['rounds']} releases each, interleaved; the writer "
            "is `WriterLock` (raw `flock(LOCK_EX)`, as the connector holds it).",
            "",
            table(
                ["reader's lock", "release -> held p50 ms", "max ms"],
                [[n, r["p50_ms"], r["max_ms"]] for n, r in res["wake"].items()],
            ),
            "",
            table(["situation", "observed"], [[k, v] for k, v in res["observed"].items()]),
        ]
    )
