"""Scale: follow mode over a directory growing to 100,000 files (50,000 samples + locks).

Three processes: a writer (``write_sample`` with locks, as fast as it can), a follower
(``HiddenStateReader(dir, follow=True)`` with its defaults, as shipped: the reader's own
inotify thread asks for creations, renames and closes only, an immediate rescan when the
kernel reports an inotify queue overflow, and a 30 s safety rescan; ``on_consumed="keep"``,
so the directory and the reader's set of known names grow to the end), and, once the
directory is full, a fresh process that times the initial scan and measures the memory
each tracked sample costs (``tracemalloc``).

For every bucket of 10,000 files the follower records its wall time, the CPU time of
its consumer thread (discovery bookkeeping, rescans, lock, load: the per-sample work of
the reader itself), of the reader's inotify thread (``hidden-state-inotify``) and of
the whole process, its RSS, its rescans and the inotify queue overflows the kernel
reported. The writer and the follower report the time of their last write and of the
last sample yielded on the same monotonic clock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Context,
    child_env,
    fmt,
    goal,
    log,
    median,
    python_module,
    run_json,
    table,
)

NAME = "scale"
TITLE = "5. Scale: following a directory that grows to 100,000 files"
SHAPE = (4, 1, 64)  # tokens, layers, hidden: ~0.5 KiB of tensors + the header
FLAT_GOAL = 1.5  # consumer CPU per sample, last bucket at most this many times the first's
SHIPPED = "as shipped"


def writer_main(argv: list[str]) -> None:
    directory, count = Path(argv[0]), int(argv[1])
    import torch

    from hidden_state_reader import write_sample

    hidden = torch.randn(*SHAPE).to(torch.bfloat16)
    tokens = torch.arange(SHAPE[0], dtype=torch.int64)
    t0 = time.perf_counter()
    for i in range(count):
        write_sample(directory / f"hs_{i}.safetensors", tokens, hidden)
    seconds = time.perf_counter() - t0
    # time.monotonic is CLOCK_MONOTONIC, shared by all processes on Linux.
    end = time.monotonic()
    print(
        json.dumps({"seconds": seconds, "count": count, "start": end - seconds, "end": end}),
        flush=True,
    )


def _thread_cpu(proc: Any, main_tid: int) -> tuple[float, float]:
    """CPU seconds so far of the consumer (this) thread and of the reader's inotify thread."""
    import threading

    inotify_tids = {
        t.native_id
        for t in threading.enumerate()
        if t.name == "hidden-state-inotify" and t.native_id is not None
    }
    main = inotify = 0.0
    for th in proc.threads():
        if th.id == main_tid:
            main += th.user_time + th.system_time
        elif th.id in inotify_tids:
            inotify += th.user_time + th.system_time
    return main, inotify


def _follow(
    reader: Any, proc: Any, count: int, bucket: int
) -> tuple[int, float, list[dict[str, Any]]]:
    """Iterate the follow-mode reader, one row of costs per ``bucket`` samples.

    Returns the samples yielded, when the ``count``-th came (monotonic) and the rows.
    """
    import threading

    main_tid = threading.get_native_id()
    rows = []
    t_prev, cpu_prev = time.perf_counter(), time.process_time()
    main_prev, inotify_prev = _thread_cpu(proc, main_tid)
    n = 0
    t_last = float("nan")
    for sample in reader:
        n += 1
        assert sample.num_tokens == SHAPE[0]
        if n == count:
            t_last = time.monotonic()
        if n % bucket == 0:
            t, cpu = time.perf_counter(), time.process_time()
            main, inotify = _thread_cpu(proc, main_tid)
            watch = reader.watch_counters
            rows.append(
                {
                    "samples": n,
                    "at": time.monotonic(),
                    "files": 2 * n,
                    "wall_s": t - t_prev,
                    "cpu_s": cpu - cpu_prev,
                    "consumer_cpu_s": main - main_prev,
                    "inotify_cpu_s": inotify - inotify_prev,
                    "rss_mb": proc.memory_info().rss / 2**20,
                    "rescans": watch.rescans if watch else None,
                    "overflows": watch.overflows if watch else None,
                    "known": watch.tracked if watch else 0,
                }
            )
            t_prev, cpu_prev, main_prev, inotify_prev = t, cpu, main, inotify
    return n, t_last, rows


def follower_main(argv: list[str]) -> None:
    directory, count, bucket = Path(argv[0]), int(argv[1]), int(argv[2])
    import psutil

    from hidden_state_reader import HiddenStateReader

    proc = psutil.Process()
    reader = HiddenStateReader(directory, follow=True, idle_timeout=120, max_samples=count)
    rss0 = proc.memory_info().rss

    print("following", flush=True)
    n, t_last, rows = _follow(reader, proc, count, bucket)
    watch = reader.watch_counters
    print(
        json.dumps(
            {
                "yielded": n,
                "last_sample_at": t_last,
                "buckets": rows,
                "rss_start_mb": rss0 / 2**20,
                "rss_end_mb": proc.memory_info().rss / 2**20,
                "stats": reader.stats.as_dict(),
                "inotify_overflows": watch.overflows if watch else None,
                "rescans": watch.rescans if watch else None,
            }
        ),
        flush=True,
    )


def scan_main(argv: list[str]) -> None:
    directory = Path(argv[0])
    import tracemalloc

    from hidden_state_reader import HiddenStateReader
    from hidden_state_reader.files.listing import list_samples
    from hidden_state_reader.read.sources import FollowSource

    out: dict[str, Any] = {"files": len(list(directory.iterdir()))}
    t = time.perf_counter()
    names = list_samples(str(directory))
    out["list_samples_s"] = time.perf_counter() - t
    out["samples"] = len(names)
    for follow in (False, True):
        t = time.perf_counter()
        reader = HiddenStateReader(directory, follow=follow, idle_timeout=5)
        first = next(iter(reader))
        out["first_yield_follow_s" if follow else "first_yield_snapshot_s"] = (
            time.perf_counter() - t
        )
        assert first.num_tokens == SHAPE[0]
        reader.close()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    source = FollowSource(str(directory), watch="poll")
    t = time.perf_counter()
    source.next(0)  # the initial scan: every name becomes known
    out["follow_scan_s"] = time.perf_counter() - t
    traced = tracemalloc.get_traced_memory()[0] - base
    known = source.tracked
    out["tracked"] = known
    out["bytes_per_tracked_sample"] = traced / max(1, known)
    source.close()
    print(json.dumps(out), flush=True)


def _follow_run(directory: Path, count: int, bucket: int) -> dict[str, Any]:
    directory.mkdir(parents=True)
    log(f"scale: writer and follower ({SHIPPED}), {count:,} samples = {2 * count:,} files")
    follower = subprocess.Popen(
        python_module("benchmarks.scale", "follower", str(directory), str(count), str(bucket)),
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    assert follower.stdout is not None
    first = follower.stdout.readline().strip()
    if first != "following":
        follower.kill()
        raise RuntimeError(f"follower did not start: {first!r}")
    written = run_json(
        python_module("benchmarks.scale", "writer", str(directory), str(count)), timeout=1800
    )
    out, _ = follower.communicate(timeout=1800)
    follow = json.loads(out.strip().splitlines()[-1])
    follow["writer"] = written
    # From the writer's first write to the follower's last sample, and from the writer's
    # last write to it (the delay a training loop sees on the last samples); one clock.
    follow["elapsed_s"] = follow["last_sample_at"] - written["start"]
    follow["lag_after_writer_s"] = max(0.0, follow["last_sample_at"] - written["end"])
    for row in follow["buckets"]:
        row["ended_s"] = row["at"] - written["start"]  # since the writer's first write
        row["writer_running"] = row["at"] < written["end"]
    if follow["buckets"]:
        # The first bucket's wall time starts at the writer's first write, not when the
        # follower began to wait (the writer process was still starting then).
        first = follow["buckets"][0]
        first["wall_s"] = min(first["wall_s"], first["ended_s"])
    for row in follow["buckets"]:
        log(
            f"scale: {row['files']:>7,} files: consumer "
            f"{row['consumer_cpu_s'] / bucket * 1e6:4.0f} \u00b5s CPU/sample, inotify thread "
            f"{row['inotify_cpu_s'] / bucket * 1e6:4.0f} \u00b5s, all threads "
            f"{row['cpu_s'] / bucket * 1e6:5.0f} \u00b5s, wall {row['wall_s'] / bucket * 1e6:6.0f} "
            f"\u00b5s; {row['rescans']} rescans, {row['overflows']} overflows"
        )
    buckets = follow["buckets"]
    inotify = [b["inotify_cpu_s"] / bucket * 1e6 for b in buckets]
    consumer = [b["consumer_cpu_s"] / bucket for b in buckets]
    follow["inotify_us_per_sample_first_bucket"] = inotify[0] if inotify else float("nan")
    follow["inotify_us_per_sample"] = sum(b["inotify_cpu_s"] for b in buckets) / count * 1e6
    follow["consumer_us_per_sample"] = sum(b["consumer_cpu_s"] for b in buckets) / count * 1e6
    follow["consumer_cpu_last_over_first"] = (
        consumer[-1] / consumer[0] if len(consumer) > 1 and consumer[0] > 0 else 1.0
    )
    follow["rss_per_sample_bytes"] = (follow["rss_end_mb"] - follow["rss_start_mb"]) * 2**20 / count
    return follow


def run(ctx: Context) -> dict[str, Any]:
    count = ctx.pick(1000, 50_000)
    bucket = ctx.pick(250, 5_000)
    work = ctx.workdir("scale")
    runs = {SHIPPED: _follow_run(work / "hs-0", count, bucket)}
    log("scale: initial scan of the full directory (fresh process)")
    scan = run_json(python_module("benchmarks.scale", "scan", str(work / "hs-0")), timeout=900)
    try:
        with open("/proc/sys/fs/inotify/max_queued_events") as f:
            inotify_queue: int | None = int(f.read())
    except OSError:
        inotify_queue = None
    shutil.rmtree(work, ignore_errors=True)
    return {
        "setup": {
            "samples": count,
            "files_at_end": 2 * count,
            "bucket_samples": bucket,
            "bucket_files": 2 * bucket,
            "sample_shape": list(SHAPE),
            "inotify_max_queued_events": inotify_queue,
            "cpus": os.cpu_count(),
            "variants": list(runs),
        },
        "runs": runs,
        "scan": scan,
        "goals": [
            goal(
                "scale: follower's consumer-thread CPU per sample, last / first 10k files",
                runs[SHIPPED]["consumer_cpu_last_over_first"],
                FLAT_GOAL,
                higher_is_better=False,
            )
        ],
    }


def _n(count: int | None, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _consumer_finding(shipped: dict[str, Any], scan: dict[str, Any], setup: dict[str, Any]) -> str:
    """The finding on the reader's own CPU per sample as the directory grows, and the scan."""
    b = setup["bucket_samples"]
    buckets = shipped["buckets"]
    per_bucket = [r["consumer_cpu_s"] / b * 1e6 for r in buckets]
    first, last = per_bucket[0], per_bucket[-1]
    ratio = shipped["consumer_cpu_last_over_first"]
    verdict = "met" if ratio <= FLAT_GOAL else "missed"
    text = (
        f"**Scale**: following a directory that grows to {setup['files_at_end']:,} files, the "
        f"reader's own work per sample (consumer thread CPU) "
        f"{'did not grow' if ratio <= 1 else 'stayed flat' if ratio <= FLAT_GOAL else 'grew'}: "
        f"{first:,.0f} \u00b5s "
        f"in the first {setup['bucket_files']:,} files, {last:,.0f} \u00b5s in the last "
        f"({ratio:.2f}\u00d7; goal \u2264 {FLAT_GOAL}\u00d7 {verdict}); per bucket "
        f"{min(per_bucket):.0f}\u2013{max(per_bucket):,.0f} \u00b5s, "
        f"{shipped['consumer_us_per_sample']:,.0f} \u00b5s over the whole run."
    )
    rescanned, quiet = [], []
    prev = 0
    for r, us in zip(buckets, per_bucket, strict=True):
        (rescanned if (r["rescans"] or 0) > prev else quiet).append(us)
        prev = r["rescans"] or 0
    if rescanned and quiet:
        text += (
            f" Buckets in which the follower rescanned the directory: median "
            f"{median(rescanned):,.0f} \u00b5s per sample ({_n(len(rescanned), 'bucket')}); "
            f"the others: {median(quiet):,.0f} \u00b5s ({_n(len(quiet), 'bucket')})."
        )
    text += (
        f" Initial scan of the full directory: first sample after "
        f"{scan['first_yield_follow_s']:.2f} s in follow mode (scan plus one `stat` per name "
        f"to order by age), {scan['first_yield_snapshot_s']:.2f} s in snapshot mode; "
        f"{scan['bytes_per_tracked_sample']:.0f} bytes of memory per tracked sample "
        "(`tracemalloc`)."
    )
    return text


def _inotify_finding(shipped: dict[str, Any], setup: dict[str, Any]) -> str:
    """The finding on the inotify thread's CPU, the writer's and follower's rates, overflows."""
    b = setup["bucket_samples"]
    buckets = shipped["buckets"]
    writer = shipped["writer"]
    overflows = shipped.get("inotify_overflows") or 0
    text = (
        "The reader's inotify thread (the watch asks for creations, renames and closes "
        f"only): {shipped['inotify_us_per_sample_first_bucket']:,.0f} \u00b5s of CPU per "
        f"sample in the first bucket, {shipped['inotify_us_per_sample']:,.0f} \u00b5s over the "
        "whole "
        f"run, against {shipped['consumer_us_per_sample']:,.0f} \u00b5s for the reader's "
        f"consumer thread. The writer wrote {writer['count'] / writer['seconds']:,.0f} "
        f"samples/s; the follower delivered all {shipped['yielded']:,} at "
        f"{shipped['yielded'] / shipped['elapsed_s']:,.0f} samples/s (from the first write "
        f"to the last sample), its last sample {shipped['lag_after_writer_s']:.2f} s after "
        f"the writer finished; the two processes share the machine's {setup.get('cpus')} "
        "CPUs."
    )
    during = [r for r in buckets if r["writer_running"]]
    after = [r for r in buckets if not r["writer_running"]]
    if after:
        r = after[0]
        text += (
            f" {_n(len(during), 'bucket')} of {len(buckets)} ended while the writer was still "
            f"writing; the one in which it finished ({r['files'] - setup['bucket_files']:,}"
            f"\u2013{r['files']:,} files) took {r['wall_s']:.2f} s: "
            f"{r['wall_s'] / b * 1e6:,.0f} \u00b5s of wall time per sample, against "
            f"{r['cpu_s'] / b * 1e6:,.0f} \u00b5s of follower CPU (the inotify thread "
            f"{r['inotify_cpu_s'] / b * 1e6:,.0f} \u00b5s, the consumer thread "
            f"{r['consumer_cpu_s'] / b * 1e6:,.0f} \u00b5s)."
        )
    rescans = shipped.get("rescans")
    if overflows:
        text += (
            f" The inotify queue ({setup['inotify_max_queued_events']} events) overflowed "
            f"{_n(overflows, 'time')} (the kernel's reports), each making the follower's next "
            "step a rescan of the directory, and "
            f"it scanned the directory {_n(rescans, 'time')} in all (the initial scan included)."
        )
    else:
        text += (
            f" The inotify queue ({setup['inotify_max_queued_events']} events) never "
            f"overflowed; the follower scanned the directory {_n(rescans, 'time')} in all "
            "(the initial scan included)."
        )
    return text


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    runs, scan, setup = res["runs"], res["scan"], res["setup"]
    shipped = runs[SHIPPED]
    return [_consumer_finding(shipped, scan, setup), _inotify_finding(shipped, setup)]


def _bucket_table(res: dict[str, Any]) -> str:
    """The per-bucket table: each follower's costs per sample as the directory grows."""
    b = res["setup"]["bucket_samples"]
    rows = []
    for variant, run in res["runs"].items():
        for r in run["buckets"]:
            rows.append(
                [
                    variant,
                    r["files"],
                    r["consumer_cpu_s"] / b * 1e6,
                    r["inotify_cpu_s"] / b * 1e6,
                    r["cpu_s"] / b * 1e6,
                    r["wall_s"] / b * 1e6,
                    r["ended_s"],
                    r["rss_mb"],
                    r["known"],
                    r["rescans"],
                    r["overflows"],
                ]
            )
    return table(
        [
            "follower",
            "files so far",
            "consumer CPU \u00b5s/sample",
            "inotify thread CPU \u00b5s/sample",
            "all threads CPU \u00b5s/sample",
            "wall \u00b5s/sample",
            "bucket ended, s",
            "RSS MB",
            "names tracked",
            "scans so far",
            "overflows so far",
        ],
        rows,
    )


def _summary_table(res: dict[str, Any]) -> str:
    """One row per follower: writer and follower rates, CPU, overflows, scans, lag, RSS."""
    return table(
        [
            "follower",
            "writer samples/s",
            "writer done, s",
            "follower samples/s overall",
            "consumer CPU \u00b5s/sample",
            "consumer CPU last \u00f7 first",
            "inotify thread CPU \u00b5s/sample (first bucket)",
            "inotify overflows",
            "scans",
            "last sample after writer done, s",
            "RSS growth bytes/sample",
        ],
        [
            [
                variant,
                run["writer"]["count"] / run["writer"]["seconds"],
                run["writer"]["seconds"],
                run["yielded"] / run["elapsed_s"],
                run["consumer_us_per_sample"],
                run["consumer_cpu_last_over_first"],
                f"{fmt(run['inotify_us_per_sample'])} "
                f"({fmt(run['inotify_us_per_sample_first_bucket'])})",
                run.get("inotify_overflows"),
                run.get("rescans"),
                run["lag_after_writer_s"],
                run["rss_per_sample_bytes"],
            ]
            for variant, run in res["runs"].items()
        ],
    )


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    b = s["bucket_samples"]
    scan = res["scan"]
    out = [
        f"{s['samples']:,} samples of {s['sample_shape'][0]} tokens \u00d7 "
        f"{s['sample_shape'][1]} layer \u00d7 {s['sample_shape'][2]} hidden, each with its "
        f"lock file ({s['files_at_end']:,} files at the end), written by one writer process "
        "as fast as it can while one follower process reads them with the reader's "
        f"defaults (the two share the {s.get('cpus')} CPUs). inotify queue: "
        f"{s['inotify_max_queued_events']} events. Per bucket of {s['bucket_files']:,} files "
        f'({b:,} samples); "consumer" is the thread iterating the reader, "inotify '
        'thread" the reader\'s one inotify thread, "all threads" the whole follower process:',
        "",
    ]
    out.append(_bucket_table(res))
    out.append("")
    out.append(_summary_table(res))
    out += [
        "",
        '"bucket ended" and "writer done": seconds since the writer\'s first write (one '
        "clock for both processes; the first bucket's wall time starts there too); "
        '"follower samples/s overall": all samples over the time '
        'from the writer\'s first write to the last sample yielded; "scans": the initial '
        "scan, the 30 s safety rescans and the rescans after an overflow.",
        "",
        f"Initial scan of the full directory ({scan['files']:,} files, {scan['samples']:,} "
        f"samples, fresh process): `list_samples` {fmt(scan['list_samples_s'])} s; first "
        f"sample yielded after {fmt(scan['first_yield_snapshot_s'])} s (snapshot) and "
        f"{fmt(scan['first_yield_follow_s'])} s (follow); the follow source's scan alone "
        f"(with `tracemalloc` on, which slows it) {fmt(scan['follow_scan_s'])} s. Memory "
        f"per tracked sample: {fmt(scan['bytes_per_tracked_sample'])} bytes "
        f"(`tracemalloc`, follow source after its initial scan of {scan['tracked']:,} "
        "names).",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "writer":
        writer_main(sys.argv[2:])
    elif role == "follower":
        follower_main(sys.argv[2:])
    elif role == "scan":
        scan_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m benchmarks.scale writer|follower|scan ... (internal)")
