"""Scenario 5: many claim-mode readers, writers still writing, readers SIGKILLed at random.

Eight claim-mode follow readers (``tests/tools/claim_worker.py``, separate processes,
``rescan_interval`` 1 s) share one directory while two writers
(``tests/tools/stream_writer.py``) write 10,000 small samples into it at a steady
rate. Every 1.5-3 s a random reader is SIGKILLed and a fresh one started in its place.

Definitions (a reader marks a sample consumed when the *next* one is requested):

* a *delivery* is a ``got`` line: the reader yielded the sample;
* a sample is *finished* by reader R when R marked its claim done; R prints ``done``
  for it when its next sample arrives or when it stops; a reader killed between
  marking and printing leaves a finished sample without a ``done`` line (its claim
  file says ``done``).

Checked:

1. nothing lost: at the end every written sample's claim says ``done``, and every
   sample was delivered;
2. exactly once for finished samples: no sample has two ``done`` lines, and no sample
   is delivered after a ``done`` line for it;
3. redelivery only after a death: if a sample was delivered more than once, every
   delivery but the last went to a reader that was then killed, and it was that
   reader's last delivery (the sample it held when it died); so redelivered samples
   <= kills;
4. every surviving reader finished (``done``) every sample it was given;
5. every delivered sample held exactly what its name promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hidden_state_reader.read.claims import ClaimStore

from procs import start_together
from tools.relkit import TOOLS, Figures

READERS = 8
PLAN = {  # samples, writing seconds
    False: (4_000, 15.0),
    True: (50_000, 150.0),
}
WRITERS = 2
IDLE = 6.0
WORK_MS = 10.0  # per sample: a kill then often lands while a reader holds a claim
KILL_EVERY = (1.0, 2.5)  # seconds between reader kills


@dataclass
class Worker:
    index: int
    pid: int
    out: Path
    killed: bool = False
    status: int | None = None


class Readers:
    """The fork server of ``claim_worker.py``: spawns, kills and reaps reader processes."""

    def __init__(self, root: Path, logs: Path) -> None:
        self.logs = logs
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(TOOLS / "claim_worker.py"),
                "serve",
                str(root),
                "--idle",
                str(IDLE),
                "--work-ms",
                str(WORK_MS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == ["ready"]
        self.workers: list[Worker] = []

    def _line(self) -> list[str]:
        assert self.proc.stdout is not None
        words = self.proc.stdout.readline().split()
        assert words, f"claim_worker server died ({self.proc.poll()})"
        return words

    def _ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line()

    def spawn(self) -> Worker:
        index = len(self.workers)
        out = self.logs / f"reader-{index:03d}.log"
        words = self._ask(f"spawn {index} {out}")
        assert words[:2] == ["pid", str(index)], words
        worker = Worker(index, int(words[2]), out)
        self.workers.append(worker)
        return worker

    def kill(self, worker: Worker) -> None:
        os.kill(worker.pid, signal.SIGKILL)
        worker.killed = True
        self.reap(worker)

    def reap(self, worker: Worker) -> None:
        words = self._ask(f"reap {worker.pid}")
        assert words[:2] == ["exit", str(worker.pid)], words
        worker.status = int(words[2])

    def close(self) -> None:
        for w in self.workers:
            if w.status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Delivery:
    time: float
    worker: int
    ok: bool


@dataclass
class Ledger:
    got: dict[str, list[Delivery]] = field(default_factory=lambda: defaultdict(list))
    done: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))
    last_got: dict[int, str] = field(default_factory=dict)
    stats: dict[int, dict[str, int]] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def read_ledger(workers: list[Worker]) -> Ledger:
    ledger = Ledger()
    for w in workers:
        for line in w.out.read_text().splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "got":
                t, name, ok = rest.split()
                ledger.got[name].append(Delivery(float(t), w.index, ok == "1"))
                ledger.last_got[w.index] = name
            elif kind == "done":
                t, name = rest.split()
                ledger.done[name].append((float(t), w.index))
            elif kind == "stats":
                ledger.stats[w.index] = json.loads(rest)
            elif kind == "error":
                raise AssertionError(f"reader {w.index} crashed: {line}")
            elif line.strip() and not line.startswith(" "):
                ledger.messages[line.strip()[:80]] += 1  # a warning on its stderr
    return ledger


def run(readers: Readers, root: Path, samples: int, seconds: float, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    per_writer = samples // WRITERS
    rate = per_writer / seconds
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                str(TOOLS / "stream_writer.py"),
                str(root),
                f"w{k}",
                str(per_writer),
                f"{rate:.3f}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(WRITERS)
    ]
    # The writers are loaded before any reader starts its idle clock.
    start_together(
        [(w, "loaded") for w in writers],
        before_go=lambda: [readers.spawn() for _ in range(READERS)],
    )
    started = time.monotonic()
    kills = 0
    while any(w.poll() is None for w in writers):
        time.sleep(rng.uniform(*KILL_EVERY))  # the fault: a reader dies at a random moment
        live = [w for w in readers.workers if not w.killed]
        readers.kill(rng.choice(live))
        kills += 1
        readers.spawn()
    writing = time.monotonic() - started
    for w in writers:
        assert w.wait(timeout=60) == 0
    for w in readers.workers:
        if not w.killed:
            readers.reap(w)  # each ends IDLE seconds after the last sample
    return {"kills": kills, "writing_s": writing, "drain_s": time.monotonic() - started - writing}


def check(root: Path, workers: list[Worker], samples: int) -> dict[str, object]:
    ledger = read_ledger(workers)
    killed = {w.index for w in workers if w.killed}
    survivors = [w for w in workers if not w.killed]
    assert all(w.status == 0 for w in survivors), "a surviving reader crashed"
    names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    assert len(names) == samples

    # 5. content
    bad = [n for n, ds in ledger.got.items() if not all(d.ok for d in ds)]
    assert not bad, f"wrong content delivered: {bad[:5]}"
    # 1. nothing lost
    undelivered = [n for n in names if n not in ledger.got]
    assert not undelivered, f"{len(undelivered)} samples never delivered: {undelivered[:5]}"
    store = ClaimStore(str(root))
    not_done = [n for n in names if not store.is_done(n)]
    assert not not_done, f"{len(not_done)} samples not consumed: {not_done[:5]}"
    # 2. exactly once for finished samples
    twice = [n for n, ds in ledger.done.items() if len(ds) > 1]
    assert not twice, f"finished twice: {twice[:5]}"
    late = [n for n, ds in ledger.done.items() if any(d.time > ds[0][0] for d in ledger.got[n])]
    assert not late, f"delivered again after being finished: {late[:5]}"
    # 3. redelivery only after the holder died, of the sample it held
    redelivered = {n: ds for n, ds in ledger.got.items() if len(ds) > 1}
    for name, ds in redelivered.items():
        ordered = sorted(ds, key=lambda d: d.time)
        for earlier in ordered[:-1]:
            assert earlier.worker in killed, f"{name}: delivered twice to live readers"
            assert ledger.last_got[earlier.worker] == name, (
                f"{name}: reader {earlier.worker} was given something after it and died "
                "without finishing this one"
            )
        if name in ledger.done:
            assert ledger.done[name][0][1] == ordered[-1].worker
    kills = len(killed)
    assert len(redelivered) <= kills
    # 4. survivors finished all they were given
    for w in survivors:
        given = {n for n, ds in ledger.got.items() for d in ds if d.worker == w.index}
        finished = {n for n, ds in ledger.done.items() if ds[0][1] == w.index}
        assert given == finished, f"reader {w.index} left {sorted(given - finished)[:5]}"
    # finished without a done line: a killed reader's last sample, consumed
    silent = [n for n in names if n not in ledger.done]
    for n in silent:
        holder = sorted(ledger.got[n], key=lambda d: d.time)[-1].worker
        assert holder in killed and ledger.last_got[holder] == n
    stats = list(ledger.stats.values())
    return {
        "deliveries": sum(len(ds) for ds in ledger.got.values()),
        "redelivered_after_kill": len(redelivered),
        "finished_silently_by_killed_reader": len(silent),
        "reclaimed": sum(s["reclaimed"] for s in stats),
        "claimed_elsewhere": sum(s["claimed_elsewhere"] for s in stats),
        "done_elsewhere": sum(s["done_elsewhere"] for s in stats),
        "per_survivor_yielded": sorted(s["yielded"] for s in stats),
        "reader_stderr": dict(ledger.messages),
    }


@pytest.fixture
def claim_dir(tmp_path: Path) -> Iterator[Path]:
    """The shared directory, on tmpfs (/dev/shm) when there is one.

    On this project's CI VM, ext4 metadata operations (create, rename) cost about 0.4 ms
    each and dominate the run time; the claim protocol is the same on both.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="hs-claims-", dir=shm))
    else:
        path = tmp_path / "hs"
        path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _scenario(hs_dir: Path, tmp_path: Path, figures: Figures, long: bool) -> None:
    samples, seconds = PLAN[long]
    logs = tmp_path / "logs"
    logs.mkdir()
    started = time.monotonic()
    readers = Readers(hs_dir, logs)
    try:
        outcome = run(readers, hs_dir, samples, seconds, seed=99 + long)
    finally:
        readers.close()
    workers = readers.workers
    result = check(hs_dir, workers, samples)
    figures.record(
        "claims",
        readers_at_once=READERS,
        reader_processes=len(workers),
        samples=samples,
        filesystem="tmpfs" if str(hs_dir).startswith("/dev/shm") else "tmp_path",
        kills=outcome["kills"],
        writing_s=round(float(outcome["writing_s"]), 1),  # type: ignore[arg-type]
        drain_after_writers_s=round(float(outcome["drain_s"]), 1),  # type: ignore[arg-type]
        total_s=round(time.monotonic() - started, 1),
        samples_per_s=round(samples / (time.monotonic() - started), 1),
        **result,
    )


def test_claim_readers_killed_at_random_exactly_once(
    claim_dir: Path, tmp_path: Path, figures: Figures
) -> None:
    _scenario(claim_dir, tmp_path, figures, long=False)


@pytest.mark.long
def test_claim_readers_killed_at_random_exactly_once_long(
    claim_dir: Path, tmp_path: Path, figures: Figures
) -> None:
    _scenario(claim_dir, tmp_path, figures, long=True)
