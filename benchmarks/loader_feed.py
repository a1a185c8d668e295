"""The loader path without a GPU: what delivering a GB of batches costs the training process.

Four ways over the same files (page cache warm), ``PackCollate``, batch size 4, one epoch
per row and round, rows interleaved: the plain ``HiddenStateReader`` loop (no batches:
the reference), ``HiddenStateLoader`` in the training process (``num_workers=0``), with 2
DataLoader worker processes, and with ``device="cpu"`` and 2 builder threads (the
``device=`` path, whose copies to a GPU are left out here). Per row: GB/s of hidden
states delivered, CPU seconds per GB of the training thread, of the whole training
process and of the worker processes, and the host copies each byte takes by construction.
A change that adds a copy or moves work onto the training thread shows here.
"""

from __future__ import annotations

import resource
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import Context, log, median, rotate, table
from benchmarks.reader import make_dataset, pass_reader

NAME = "loader_feed"
TITLE = "17. Loader path (CPU per GB delivered: training thread, process, workers)"
BATCH = 4

# Host copies of each hidden-state byte between the page cache and the batch the loop
# gets (a CUDA trainer's device copy is not a host copy): by construction, see
# docs/training.md "How fast can my trainer go?".
COPIES = {
    "reader loop": "0 (mapped file)",
    "loader, no workers": "1 (collate)",
    "loader, 2 worker processes": "1 (collate, into shared memory); +1 with pin_memory",
    "loader, device=, 2 threads": "1 (collate; into page-locked memory on CUDA)",
}


def _cpu() -> tuple[float, float, float]:
    """(training thread, this process, reaped children) CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.thread_time(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _epoch(root: Path, kind: str) -> dict[str, Any]:
    """One epoch of ``kind``; bytes of hidden states delivered and the CPU it took."""
    from benchmarks.reader import touch
    from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, pack_collate

    before, t0 = _cpu(), time.perf_counter()
    delivered = 0
    if kind == "reader loop":
        pass_reader(root)
    else:
        workers = 0 if kind == "loader, no workers" else 2
        extra: dict[str, Any] = {"device": "cpu"} if "device" in kind else {}
        loader = HiddenStateLoader(
            HiddenStateDataset(root), BATCH, collate_fn=pack_collate, num_workers=workers, **extra
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # more workers than the 2 cores suggest
            for batch in loader:
                touch(batch["hidden_states"])  # the loop reads what it got
                delivered += batch["hidden_states"].nbytes
    seconds = time.perf_counter() - t0
    after = _cpu()
    thread, process, children = (a - b for a, b in zip(after, before, strict=True))
    return {
        "seconds": seconds,
        "bytes": delivered,
        "thread_cpu_s": thread,
        "process_cpu_s": process,
        "worker_cpu_s": children,
    }


def run(ctx: Context) -> dict[str, Any]:
    import random

    work = ctx.workdir("loader_feed")
    rng = random.Random(3)
    count = ctx.pick(12, 96)
    lengths = [rng.randint(256, 2048) for _ in range(count)]
    log(f"loader_feed: writing {count} samples")
    nbytes = make_dataset(work, lengths, 4, 1024)
    pass_reader(work)  # warm the page cache
    kinds = list(COPIES)
    per: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    rounds = ctx.pick(1, 3)
    for r in range(rounds):
        for kind in rotate(kinds, r):
            row = _epoch(work, kind)
            row["bytes"] = row["bytes"] or nbytes  # the reader loop touches every sample
            per[kind].append(row)
            rate = row["bytes"] / row["seconds"] / 1e9
            log(f"loader_feed: round {r + 1}/{rounds} {kind:28s} {rate:.2f} GB/s")
    summary = {}
    for kind, rows in per.items():
        gb = [row["bytes"] / 1e9 for row in rows]
        summary[kind] = {
            "gb_s": median([g / row["seconds"] for g, row in zip(gb, rows, strict=True)]),
            "thread_cpu_s_per_gb": median(
                [row["thread_cpu_s"] / g for g, row in zip(gb, rows, strict=True)]
            ),
            "process_cpu_s_per_gb": median(
                [row["process_cpu_s"] / g for g, row in zip(gb, rows, strict=True)]
            ),
            "worker_cpu_s_per_gb": median(
                [row["worker_cpu_s"] / g for g, row in zip(gb, rows, strict=True)]
            ),
            "host_copies": COPIES[kind],
        }
    reader = summary["reader loop"]["gb_s"]
    for row in summary.values():
        row["vs_reader_loop"] = row["gb_s"] / reader if reader else None
    return {
        "setup": {"samples": count, "tensor_bytes": nbytes, "rounds": rounds, "batch": BATCH},
        "summary": summary,
        "goals": [],
    }


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    s = res["summary"]
    dev, procs = s["loader, device=, 2 threads"], s["loader, 2 worker processes"]
    return [
        f"**Loader path** (no GPU): `device=` with 2 threads delivers {dev['gb_s']:.2f} GB/s "
        f"({dev['vs_reader_loop']:.2f}x the reader loop) for "
        f"{dev['process_cpu_s_per_gb']:.2f} CPU-s per GB in the training process; 2 worker "
        f"processes deliver {procs['gb_s']:.2f} GB/s for {procs['thread_cpu_s_per_gb']:.2f} "
        f"CPU-s per GB of the training thread plus {procs['worker_cpu_s_per_gb']:.2f} in the "
        "workers."
    ]


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    head = (
        f"{s['samples']} samples of 256\u20132048 tokens \u00d7 4 layers \u00d7 1024 hidden "
        f"(bf16, {s['tensor_bytes'] / 1e9:.2f} GB), `pack_collate`, batch size {s['batch']}, "
        f"page cache warm, one epoch per row and round, {s['rounds']} round(s) interleaved; "
        "medians. The loop reads every byte it gets. Worker processes start each epoch (their "
        "start-up is in the row); their CPU is counted once they have exited."
    )
    rows = [
        [
            kind,
            v["gb_s"],
            v["vs_reader_loop"],
            v["thread_cpu_s_per_gb"],
            v["process_cpu_s_per_gb"],
            v["worker_cpu_s_per_gb"],
            v["host_copies"],
        ]
        for kind, v in res["summary"].items()
    ]
    header = [
        "path",
        "GB/s delivered",
        "vs reader loop",
        "training thread CPU-s/GB",
        "training process CPU-s/GB",
        "worker processes CPU-s/GB",
        "host copies per byte",
    ]
    return "\n".join([head, "", table(header, rows)])
