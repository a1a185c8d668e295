"""Claims at scale: what a sample costs a consumer group as the group grows.

A producer publishes small samples into a tmpfs directory at a fixed rate, the way the
connector does (lock held, file linked into place complete, lock released:
``benchmarks.consume_roles produce``). ``N`` reader processes follow the directory as one
consumer group (``follow=True, claim=True, on_consumed="delete"``, otherwise defaults)
for ``N`` in 1, 2, 4, 8, 16 (quick: 1, 4). Per ``N``:

* **CPU per delivered sample**: user + system CPU of all readers (``getrusage`` at the
  end, the inotify thread included) over the samples delivered, after subtracting what
  each reader spent before its first sample (imports, start-up);
* **failed claim attempts per sample**: the readers' ``claimed_elsewhere``,
  ``done_elsewhere`` and ``vanished`` (a look at a sample another reader had) over the
  samples delivered;
* **metadata operations per sample**: in a second run with the same plan, the readers
  under ``strace -f -c`` counting file-name and lock system calls (``open``, ``stat``,
  ``link``, ``unlink``, ``rename``, ``flock``, ``getdents``...), less what each reader's
  start-up, idle tail and exit cost (one reader of an empty run), over the samples
  delivered;
* **yield latency** p50/p99 (publication to the reader's ``next``), **fairness** (the
  smallest and largest share of one reader, times ``N``), and exactly-once (every
  published sample delivered once).

Then the same with 4 readers, one of them killed (``SIGKILL``) mid-run: nothing lost,
nothing twice (the sample the killed reader held when it died may be delivered again:
it never finished it), and the **takeover**: the latest delivery, relative to its
publication, of samples published around the kill.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    child_entry,
    child_env,
    fmt,
    goal,
    log,
    percentile,
    python_module,
    table,
)

NAME = "claims"
TITLE = "16. Claims: one consumer group of 1 to 16 readers over one directory"
CPU_GOAL = 2.0  # CPU per sample at 16 readers, at most this many times one reader's
SHAPE = (16, 1, 64)  # tokens, layers, hidden: ~2 KiB samples (claims, not bytes, cost)
KILLED_READERS = 4
_TMPFS = "/dev/shm"


@dataclass(frozen=True)
class Plan:
    """One run's pace and sizes."""

    samples: int
    rate: float
    readers: tuple[int, ...]
    idle: float = 3.0
    strace_readers: tuple[int, ...] | None = None  # group sizes counted under strace (all)


# The quick run (a smoke test of this code) counts system calls of the one-reader group
# only: a group of readers under ``strace -f`` was a quarter of the quick section's time.
QUICK = Plan(samples=150, rate=100.0, readers=(1, 4), strace_readers=(1,))
FULL = Plan(samples=600, rate=100.0, readers=(1, 2, 4, 8, 16))


def reader_main(argv: list[str]) -> None:
    """``reader DIR RECORDS IDLE``: consume as one of the group; records and stats."""
    from hidden_state_reader import HiddenStateReader

    directory, records, idle = argv[0], Path(argv[1]), float(argv[2])
    reader = HiddenStateReader(directory, follow=True, claim=True, on_consumed="delete",
                               idle_timeout=idle)  # fmt: skip
    start_cpu = None
    print("ready", flush=True)
    with open(records.with_suffix(".lines"), "w", buffering=1) as lines:
        for sample in reader:
            if start_cpu is None:
                start_cpu = _cpu()
            # One line per sample as it comes: a reader killed mid-run leaves its record.
            lines.write(f"{os.path.basename(sample.path)}\t{time.time()}\n")
    end = _cpu()
    busy = end - (start_cpu if start_cpu is not None else end)
    summary = {"cpu_s": busy, "threads": _thread_cpu(), "stats": reader.stats.as_dict()}
    records.write_text(json.dumps(summary))


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by Python thread name (``/proc``)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "other")
        out[name] = out.get(name, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _staged(work: Path) -> list[str]:
    import torch

    from hidden_state_reader.files.publish import write_sample

    tokens, layers, hidden = SHAPE
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(4):
        x = torch.randn(tokens, layers, hidden, generator=gen).bfloat16()
        paths.append(str(write_sample(work / f"staged-{i}.safetensors", torch.arange(tokens),
                                      x, use_lock=False)))  # fmt: skip
    return paths


def _strace_prefix(out: Path) -> list[str]:
    calls = "trace=%file,flock,getdents64,unlink,unlinkat,rename,renameat2,link,linkat"
    return ["strace", "-f", "-c", "-o", str(out), "-e", calls]


def group_run(plan: Plan, readers: int, work: Path, staged: list[str], *, strace: bool = False,
              kill_at: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One producer, ``readers`` readers; optionally reader 0 killed after ``kill_at`` puts."""
    directory = work / "samples"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    procs = []
    for i in range(readers):
        cmd = python_module("benchmarks.claims", "reader", str(directory),
                            str(logs / f"reader-{i}.json"), str(plan.idle))  # fmt: skip
        if strace:
            cmd = _strace_prefix(logs / f"strace-{i}.txt") + cmd
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env()))
    produced = logs / "producer.json"
    pace = [str(plan.samples), str(plan.rate)]
    producer_cmd = python_module("benchmarks.consume_roles", "produce", str(directory),
                                 str(produced), *pace, *staged)  # fmt: skip
    writer = subprocess.Popen(producer_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=child_env())  # fmt: skip
    killed_at = None
    try:
        for proc in [*procs, writer]:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a process did not start (exit {proc.wait()})")
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.close()
        if kill_at is not None:
            time.sleep(kill_at / plan.rate)  # the benchmark's own clock: the kill moment
            procs[0].send_signal(signal.SIGKILL)
            killed_at = time.time()
        if writer.wait(timeout=600):
            raise RuntimeError(f"the producer failed (exit {writer.returncode})")
        for i, proc in enumerate(procs):
            code = proc.wait(timeout=120 + plan.idle)
            if code and not (kill_at is not None and i == 0):
                raise RuntimeError(f"reader {i} failed (exit {code})")
    finally:
        for proc in [*procs, writer]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    published = dict(json.loads(produced.read_text())["published"])
    return _figures(published, logs, readers, strace, killed_at)


def _figures(published: dict[str, float], logs: Path, readers: int, strace: bool,
             killed_at: float | None) -> dict[str, Any]:  # fmt: skip
    got: list[tuple[str, float, int]] = []
    cpu = 0.0
    failed = reclaimed = 0
    for i in range(readers):
        for line in (logs / f"reader-{i}.lines").read_text().splitlines():
            name, at = line.split("\t")
            got.append((name, float(at), i))
        summary = logs / f"reader-{i}.json"
        if summary.exists():  # not for a killed reader
            doc = json.loads(summary.read_text())
            cpu += doc["cpu_s"]
            stats = doc["stats"]
            failed += stats["claimed_elsewhere"] + stats["done_elsewhere"] + stats["vanished"]
            reclaimed += stats["reclaimed"]
    names = [n for n, _, _ in got]
    delivered = len(names)
    shares = [sum(1 for _, _, r in got if r == i) for i in range(readers)]
    latency = [(at - published[n]) * 1e3 for n, at, _ in got if n in published]
    out: dict[str, Any] = {
        "readers": readers,
        "produced": len(published),
        "consumed": len(set(names)),
        "duplicates": delivered - len(set(names)),
        "unknown": len(set(names) - set(published)),
        "cpu_ms_per_sample": cpu * 1e3 / max(1, delivered),
        "failed_claims_per_sample": failed / max(1, delivered),
        "reclaimed": reclaimed,
        "yield_latency_p50_ms": percentile(latency, 50),
        "yield_latency_p99_ms": percentile(latency, 99),
        "share_min_x_n": min(shares) * readers / max(1, delivered),
        "share_max_x_n": max(shares) * readers / max(1, delivered),
    }
    if strace:
        out["metadata_calls"] = _strace_calls(logs, readers)
    if killed_at is not None:
        around = [(at - published[n]) for n, at, r in got
                  if n in published and abs(published[n] - killed_at) < 2.0 and r != 0]  # fmt: skip
        out["takeover_s"] = max(around, default=0.0)
        out["killed_reader_delivered"] = shares[0]
    return out


def _strace_calls(logs: Path, readers: int) -> int:
    """Total calls from ``strace -c`` summaries (its ``total`` line)."""
    total = 0
    for i in range(readers):
        for line in (logs / f"strace-{i}.txt").read_text().splitlines():
            parts = line.split()
            if parts and parts[-1] == "total":
                total += int(parts[3])  # % time, seconds, usecs/call, calls[, errors]
    return total


def measure(plan: Plan, work: Path) -> dict[str, Any]:
    """Every group size, then the kill run."""
    staged = _staged(work)
    # What one reader's start-up, idle tail and exit cost in such calls: subtracted.
    per_reader = 0
    if shutil.which("strace"):
        idle = group_run(replace(plan, samples=0), 1, work / "idle", staged, strace=True)
        per_reader = idle["metadata_calls"]
    rows = []
    for readers in plan.readers:
        log(f"claims: {readers} reader(s), {plan.samples} samples at {plan.rate}/s")
        row = group_run(plan, readers, work / f"n{readers}", staged)
        if shutil.which("strace") and readers in (plan.strace_readers or plan.readers):
            counted = group_run(plan, readers, work / f"n{readers}-strace", staged, strace=True)
            extra = counted["metadata_calls"] - readers * per_reader
            row["metadata_ops_per_sample"] = extra / max(1, counted["consumed"])
        rows.append(row)
    log(f"claims: {KILLED_READERS} readers, one killed mid-run")
    kill = group_run(plan, KILLED_READERS, work / "kill", staged, kill_at=plan.samples // 2)
    return {"plan": asdict(plan), "rows": rows, "kill": kill, "loadavg": list(os.getloadavg())}


def _goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = res["rows"]
    one, most = rows[0], rows[-1]
    out = [goal(f"claims ({r['readers']} readers): delivered exactly once / produced",
                (r["consumed"] - r["duplicates"] - r["unknown"]) / max(1, r["produced"]), 1.0)
           for r in rows]  # fmt: skip
    kill = res["kill"]
    delivered = (kill["consumed"] - kill["unknown"]) / max(1, kill["produced"])
    out.append(goal("claims (one of 4 readers killed): delivered / produced", delivered, 1.0))
    if most is not one:
        out.append(goal(f"claims: CPU per sample, {most['readers']} readers / 1 reader",
                        most["cpu_ms_per_sample"] / one["cpu_ms_per_sample"], CPU_GOAL,
                        higher_is_better=False))  # fmt: skip
    return out


def run(ctx: Any) -> dict[str, Any]:
    plan = ctx.pick(QUICK, FULL)
    # tmpfs where there is one: claims cost metadata operations, not bytes, and a disk's
    # journal would be part of what is measured.
    with tempfile.TemporaryDirectory(dir=_TMPFS if os.path.isdir(_TMPFS) else None) as d:
        res = measure(plan, Path(d) if os.path.isdir(_TMPFS) else ctx.workdir(NAME))
    res["goals"] = _goals(res)
    return res


HEADER = ["readers", "delivered once / produced", "CPU ms per sample (all readers)",
          "failed claim attempts per sample", "metadata ops per sample", "yield p50 / p99 ms",
          "smallest / largest share x N"]  # fmt: skip


def render(res: dict[str, Any]) -> str:
    p = res["plan"]
    rows = [
        [r["readers"], f"{r['consumed'] - r['duplicates']} / {r['produced']}",
         r["cpu_ms_per_sample"], r["failed_claims_per_sample"],
         r.get("metadata_ops_per_sample"),
         f"{fmt(r['yield_latency_p50_ms'])} / {fmt(r['yield_latency_p99_ms'])}",
         f"{fmt(r['share_min_x_n'])} / {fmt(r['share_max_x_n'])}"]
        for r in res["rows"]
    ]  # fmt: skip
    k = res["kill"]
    return "\n".join([
        f"{p['samples']} samples of {SHAPE[0]} tokens published at {fmt(p['rate'])}/s into a "
        "tmpfs directory; the readers follow it as one group (`follow=True, claim=True, "
        "on_consumed=\"delete\"`). Metadata operations: file-name and lock system calls "
        "(`strace -c`, a second run).",
        "",
        table(HEADER, rows),
        "",
        f"One of {KILLED_READERS} readers killed after {p['samples'] // 2} publications: "
        f"{k['consumed']} of {k['produced']} delivered, {k['duplicates']} twice, "
        f"{k['reclaimed']} taken over; samples published within 2 s of the kill were "
        f"delivered at most {fmt(k['takeover_s'])} s after publication.",
    ])  # fmt: skip


def findings(res: dict[str, Any]) -> list[str]:
    one, most = res["rows"][0], res["rows"][-1]
    return [f"**Claims**: CPU per sample {fmt(one['cpu_ms_per_sample'])} ms with 1 reader, "
            f"{fmt(most['cpu_ms_per_sample'])} ms with {most['readers']}; failed claim attempts "
            f"per sample {fmt(most['failed_claims_per_sample'])} at {most['readers']}; "
            f"takeover after a kill {fmt(res['kill']['takeover_s'])} s"]  # fmt: skip


def main(argv: list[str]) -> None:
    """``python -m benchmarks.claims measure [--quick]``: print the result as JSON."""
    plan = QUICK if "--quick" in argv else FULL
    with tempfile.TemporaryDirectory(dir=_TMPFS if os.path.isdir(_TMPFS) else None) as d:
        print(json.dumps(measure(plan, Path(d))))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "measure":
        main(sys.argv[2:])
    else:
        child_entry("reader", reader_main, __doc__ or "")
