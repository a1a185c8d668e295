"""Directory watchers: the reader's own inotify reader and poller vs watchdog's observers.

The reader follows a directory with its own code (``read/sources.py``): one inotify
instance and one thread per process, read with ``ctypes``, or, with ``watch="poll"``
(NFS/Lustre, where inotify never sees other hosts' writes), a rescan of the directory
every ``poll_interval`` in the consumer's own thread. This benchmark measures the two
against the observers of ``watchdog`` (which the project card names), on the same files:

* ``reader inotify``: ``FollowSource(dir, watch="inotify")``.
* ``reader poll``: ``FollowSource(dir, watch="poll", poll_interval=1.0)``.
* ``watchdog inotify``: ``InotifyObserver`` asked for creations, renames and closes only
  (the events the reader's own watch asks for), a handler that keeps sample names.
* ``watchdog polling``: ``PollingObserver(timeout=1.0)`` (a ``DirectorySnapshot`` diff
  per tick), the same handler.

Each watcher runs in a fresh child process (``python -m benchmarks.watchers watch ...``),
so its CPU time and threads are its own; this process writes the files:

1. **latency**: one file at a time renamed into place (``NAME.safetensors.tmp.* ->
   NAME.safetensors``, as writers publish), ``CLOCK_MONOTONIC`` after the rename; the
   child records the same clock when the name reaches its consumer.
2. **burst**: samples written as fast as ``write_sample`` goes (lock, temp file, rename,
   unlock: the events a live server causes); the child's CPU time (all its threads) from
   ready to "every name seen and the queue quiet", per sample.
3. **rescan**: a directory of N files (data + lock per sample) that does not change; CPU
   time of one rescan: the reader's poller (``os.scandir``, name checks, set
   differences) vs watchdog's polling emitter (``DirectorySnapshot``: a ``stat`` of every
   entry, then ``DirectorySnapshotDiff``), in this process's thread.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from benchmarks.common import (
    Context,
    child_entry,
    child_env,
    fmt,
    log,
    median,
    percentile,
    python_module,
    table,
)

NAME = "watchers"
TITLE = "12. Directory watchers: the reader's own vs watchdog's observers"
POLL_INTERVAL = 1.0  # both pollers' default (quick mode: 0.25 s, to keep it short)
QUIET = 0.3  # seconds without news that end a child's drain
KINDS = ("reader inotify", "reader poll", "watchdog inotify", "watchdog polling")


class _Watcher(Protocol):
    def get(self, timeout: float) -> str | None: ...

    def stop(self) -> None: ...


class _Own:
    """The reader's ``FollowSource``: each name once (first seen by its lock or data)."""

    def __init__(self, root: str, watch: str, interval: float) -> None:
        from hidden_state_reader.read.sources import FollowSource

        self.source = FollowSource(root, watch=watch, poll_interval=interval)
        self.source.take()  # the initial scan

    def get(self, timeout: float) -> str | None:
        return self.source.next(timeout)

    def stop(self) -> None:
        self.source.close()


class _Watchdog:
    """A watchdog observer whose handler keeps what the reader keeps: sample names, once."""

    def __init__(self, root: str, polling: bool, interval: float) -> None:
        from watchdog.events import (
            FileClosedEvent,
            FileCreatedEvent,
            FileMovedEvent,
            FileSystemEvent,
            FileSystemEventHandler,
        )
        from watchdog.observers.inotify import InotifyObserver
        from watchdog.observers.polling import PollingObserver

        from hidden_state_reader.format.names import sample_key

        names: queue.SimpleQueue[str] = queue.SimpleQueue()

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                path = getattr(event, "dest_path", "") or event.src_path
                key = sample_key(os.path.basename(os.fsdecode(path)))
                if key is not None:
                    names.put(key)

        self.names = names
        self.seen: set[str] = set()
        self.observer = PollingObserver(timeout=interval) if polling else InotifyObserver()
        kinds = [FileCreatedEvent, FileMovedEvent, FileClosedEvent]
        self.observer.schedule(Handler(), root, recursive=False, event_filter=kinds)
        self.observer.start()

    def get(self, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while True:
            try:
                key = self.names.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return None
            if key not in self.seen:
                self.seen.add(key)
                return key

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join()


def _start(kind: str, root: str, interval: float) -> _Watcher:
    if kind == "reader inotify":
        return _Own(root, "inotify", interval)
    if kind == "reader poll":
        return _Own(root, "poll", interval)
    return _Watchdog(root, kind == "watchdog polling", interval)


def watch_main(argv: list[str]) -> None:
    """Child: watch ``root`` until ``count`` names were seen and stdin said "done"."""
    kind, root, count, interval = argv[0], argv[1], int(argv[2]), float(argv[3])
    before = threading.active_count()
    watcher = _start(kind, root, interval)
    threads = threading.active_count() - before
    if kind == "reader inotify":
        threads = 1  # one per process, shared by every follower (it may predate this one)
    cpu0 = time.process_time()
    print("ready", flush=True)
    arrivals: dict[str, float] = {}
    while len(arrivals) < count:
        name = watcher.get(60.0)
        if name is None:
            break
        arrivals[name] = time.monotonic()
    sys.stdin.readline()  # the writer is done
    timeout = QUIET + (interval if "poll" in kind else 0.0)
    while watcher.get(timeout) is not None:
        pass  # drain: the events of the last files still count
    cpu = time.process_time() - cpu0  # every thread of this process (waiting costs none)
    watcher.stop()
    print(json.dumps({"arrivals": arrivals, "cpu_s": cpu, "threads": threads}))


def _spawn(ctx: Context, kind: str, root: Path, count: int) -> subprocess.Popen[str]:
    interval = ctx.pick(0.25, POLL_INTERVAL)
    proc = subprocess.Popen(
        python_module("benchmarks.watchers", "watch", kind, str(root), str(count), str(interval)),
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"watcher {kind!r} did not start (exit {proc.wait()})")
    return proc


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate("done\n", timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"watcher exited {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def _publish_renames(root: Path, count: int, gap: float, done_dir: Path | None) -> dict[str, float]:
    """Rename ``count`` files into place, ``gap`` apart; the clock after each rename.

    With ``done_dir``, each file is moved there before the next one is published, as a
    reader with ``on_consumed="move"`` does (and the quarantine does with bad files).
    """
    from hidden_state_reader.format.names import temp_path

    published = {}
    for i in range(count):
        if done_dir is not None and i:
            name = f"hs_{i - 1}.safetensors"
            os.replace(root / name, done_dir / name)
        final = str(root / f"hs_{i}.safetensors")
        tmp = temp_path(final)
        with open(tmp, "wb") as f:
            f.write(b"x" * 64)
        os.replace(tmp, final)
        published[os.path.basename(final)] = time.monotonic()
        time.sleep(gap)
    return published


def _latency(ctx: Context, kind: str, count: int, gap: float, *, move_out: bool) -> dict[str, Any]:
    root = ctx.workdir("watchers-latency")
    done_dir = ctx.workdir("watchers-done") if move_out else None
    proc = _spawn(ctx, kind, root, count)
    published = _publish_renames(root, count, gap, done_dir)
    res = _finish(proc)
    lat = [(res["arrivals"][n] - t) * 1e3 for n, t in published.items() if n in res["arrivals"]]
    return {
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=float("nan")),
        "seen": len(lat),
        "threads": res["threads"],
    }


def _burst(ctx: Context, kind: str, count: int) -> dict[str, Any]:
    import torch

    from hidden_state_reader.files.publish import write_sample

    root = ctx.workdir("watchers-burst")
    token_ids = torch.arange(4)
    hidden = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    proc = _spawn(ctx, kind, root, count)
    t0 = time.perf_counter()
    for i in range(count):
        write_sample(root / f"hs_{i}.safetensors", token_ids, hidden)
    write_s = time.perf_counter() - t0
    res = _finish(proc)
    return {
        "cpu_us_per_sample": res["cpu_s"] / count * 1e6,
        "seen": len(res["arrivals"]),
        "writer_samples_per_s": count / write_s,
    }


def _fill(root: Path, samples: int) -> None:
    for i in range(samples):
        for suffix in (".safetensors", ".safetensors.lock"):
            os.close(os.open(root / f"hs_{i}{suffix}", os.O_CREAT | os.O_WRONLY, 0o644))


def _rescan_cpu(root: Path, rounds: int) -> dict[str, float]:
    """Thread CPU seconds of one rescan of an unchanged directory: reader poll, watchdog."""
    from watchdog.observers.api import EventQueue, ObservedWatch
    from watchdog.observers.polling import PollingEmitter

    from hidden_state_reader.read.sources import FollowSource

    own = FollowSource(str(root), watch="poll", poll_interval=0.0)  # every take rescans
    own.take()
    emitter = PollingEmitter(EventQueue(), ObservedWatch(str(root), recursive=False), timeout=0)
    emitter.on_thread_start()  # its first snapshot
    times: dict[str, list[float]] = {"reader poll": [], "watchdog polling": []}
    for _ in range(rounds):  # interleaved
        t = time.thread_time()
        own.take()
        times["reader poll"].append(time.thread_time() - t)
        t = time.thread_time()
        emitter.queue_events(0)
        times["watchdog polling"].append(time.thread_time() - t)
    own.close()
    return {k: median(v) for k, v in times.items()}


def run(ctx: Context) -> dict[str, Any]:
    lat_count, gap = ctx.pick(10, 200), 0.02
    burst_count = ctx.pick(300, 10000)
    sizes = ctx.pick([2_000], [10_000, 100_000])
    rounds = ctx.pick(3, 7)
    latency, moving, burst = {}, {}, {}
    for kind in KINDS:
        latency[kind] = _latency(ctx, kind, lat_count, gap, move_out=False)
        if "inotify" in kind:  # pollers do not see moves apart from creations
            # watchdog holds each for 0.5 s: fewer files keep this part short
            moving[kind] = _latency(ctx, kind, ctx.pick(10, 40), gap, move_out=True)
        burst[kind] = _burst(ctx, kind, burst_count)
        log(
            f"{NAME}: {kind}: latency p50 {latency[kind]['p50_ms']:.2f} ms "
            f"({moving.get(kind, {}).get('p50_ms', float('nan')):.2f} ms while files move "
            f"out), {burst[kind]['cpu_us_per_sample']:.0f} \u00b5s CPU/sample in a burst"
        )
    rescans = []
    for files in sizes:
        root = ctx.workdir("watchers-rescan")
        _fill(root, files // 2)
        cpu = _rescan_cpu(root, rounds)
        rescans.append({"files": files, **{k: v * 1e3 for k, v in cpu.items()}})
        log(f"{NAME}: rescan of {files:,} files: {cpu}")
    ctx.workdir("watchers-rescan")  # empty it again
    return {
        "setup": {
            "latency_files": lat_count,
            "gap_s": gap,
            "burst_samples": burst_count,
            "poll_interval_s": ctx.pick(0.25, POLL_INTERVAL),
            "rescan_rounds": rounds,
            "watchdog": _watchdog_version(),
        },
        "latency": latency,
        "latency_moving_out": moving,
        "burst": burst,
        "rescan_ms": rescans,
        "goals": [],
    }


def _watchdog_version() -> str:
    from importlib.metadata import version

    return version("watchdog")


def findings(res: dict[str, Any]) -> list[str]:
    lat, mov, burst = res["latency"], res["latency_moving_out"], res["burst"]
    own, wd = "reader inotify", "watchdog inotify"
    big = res["rescan_ms"][-1]
    return [
        f"Watchers: the reader's inotify reader delivers a renamed-in file in "
        f"{lat[own]['p50_ms']:.2f} ms (p50; p99 {lat[own]['p99_ms']:.2f} ms; "
        f"{mov[own]['p50_ms']:.2f} ms while consumed files move out) with "
        f"{lat[own]['threads']} thread per process; watchdog's InotifyObserver in "
        f"{lat[wd]['p50_ms']:.2f} ms, but {mov[wd]['p50_ms']:.0f} ms (p99 "
        f'{mov[wd]["p99_ms"]:.0f} ms) while consumed files move out (`on_consumed="move"`, '
        "quarantine: its move-pairing queue holds every later event behind an unpaired "
        f"move for 0.5 s), with {lat[wd]['threads']} threads per observer, and "
        f"{fmt(burst[wd]['cpu_us_per_sample'])} \u00b5s of CPU per written sample against "
        f"{fmt(burst[own]['cpu_us_per_sample'])} \u00b5s. Polling a directory of "
        f"{big['files']:,} files: {fmt(big['reader poll'])} ms of CPU per rescan for the "
        f"reader's poller, {fmt(big['watchdog polling'])} ms for watchdog's "
        "PollingObserver (it stats every file)."
    ]


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    lat, mov, burst = res["latency"], res["latency_moving_out"], res["burst"]
    nan = {"p50_ms": None, "p99_ms": None}
    return "\n".join(
        [
            f"watchdog {s['watchdog']}. Each watcher in its own process. Latency: "
            f"{s['latency_files']} files renamed into place {s['gap_s'] * 1e3:.0f} ms apart "
            '(rename -> name in the consumer\'s hands); "moving out": the same while each '
            'previous file is moved to another directory (as `on_consumed="move"` and the '
            "quarantine do). Burst: "
            f"{s['burst_samples']:,} samples written by `write_sample` as fast as it goes "
            "(lock, temp file, rename, unlock); CPU of the watcher's whole process until "
            f"every name was seen. Pollers: every {s['poll_interval_s']:g} s (1 s is both "
            "defaults).",
            "",
            table(
                [
                    "watcher",
                    "latency p50 ms",
                    "p99 ms",
                    "max ms",
                    "moving out: p50 ms",
                    "moving out: p99 ms",
                    "threads it starts",
                    "burst CPU \u00b5s/sample",
                    "writer samples/s meanwhile",
                ],
                [
                    [
                        k,
                        lat[k]["p50_ms"],
                        lat[k]["p99_ms"],
                        lat[k]["max_ms"],
                        mov.get(k, nan)["p50_ms"],
                        mov.get(k, nan)["p99_ms"],
                        lat[k]["threads"],
                        burst[k]["cpu_us_per_sample"],
                        burst[k]["writer_samples_per_s"],
                    ]
                    for k in KINDS
                ],
            ),
            "",
            f"CPU of one rescan of an unchanged directory (median of {s['rescan_rounds']}, "
            "interleaved; half data files, half locks):",
            "",
            table(
                ["files", "reader poll ms", "watchdog PollingObserver ms", "watchdog ÷ reader"],
                [
                    [
                        r["files"],
                        r["reader poll"],
                        r["watchdog polling"],
                        r["watchdog polling"] / r["reader poll"],
                    ]
                    for r in res["rescan_ms"]
                ],
            ),
        ]
    )


if __name__ == "__main__":
    child_entry(
        "watch", watch_main, "usage: python -m benchmarks.watchers watch KIND DIR COUNT INTERVAL"
    )
