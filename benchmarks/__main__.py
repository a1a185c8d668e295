"""``python -m benchmarks``: run the benchmarks, write docs/benchmarks.md and .json."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import BENCHMARKS
from benchmarks.common import (
    REPO,
    Context,
    OtherLoad,
    busy_processes,
    log,
    machine,
    versions,
)
from benchmarks.report import render_markdown

EPILOG = """\
benchmarks (run in this order):
  server      vLLM CPU prompt tokens/s: ours vs extraction + null sink vs no extraction
  write       the connector's write pipeline vs raw sequential writes (same filesystem)
  reader      HiddenStateReader vs a raw read loop and the naive loops (warm and cold cache)
  latency     writer releases the lock -> follow-mode reader yields (vs a 100 ms polling loop)
  scale       follow mode over a directory growing to 100,000 files
  dataloader  HiddenStateLoader: workers 0/1/2, pin_memory, pad vs pack collation
  completion_order  live vLLM, 16 concurrent mixed clients: publication -> yield per sample
  release     offline engine: lock released after generate() returns, this checkout vs baseline
  fp8         fp8 storage vs bf16: file bytes, per-layer error on real states, write/read GB/s
  store       Mooncake Store vs files: samples/s and GB/s, put/get over loopback (needs root);
              full mode adds vLLM CPU prompt tok/s, store backend vs file backend
  cli_startup  hidden-state --help/--version/argument errors: wall time of a fresh process
  watchers    the reader's inotify reader and poller vs watchdog's observers: latency, CPU
  loaders     the reader's loader vs safetensors' load_file / safe_open on the same files
  locks       the reader's SharedLock vs filelock against a raw-flock writer
  consume     a producer at a fixed rate, N follow + claim + delete readers: bf16, fp8
              (CPU; device where CUDA is), store: GB/s per reader, backlog, latency
  claims      one consumer group of 1-16 follow + claim + delete readers: CPU, failed claim
              attempts and metadata calls per sample, latency, fairness, a reader killed
  loader_feed  the loader path without a GPU: GB/s delivered and CPU-s per GB of the
              training thread, process and workers; reader loop, workers, device= threads

examples:
  python -m benchmarks                          # full run (~15 min here), writes docs/
  python -m benchmarks --quick --out /tmp/b     # smoke run (~1.5 min idle), tiny sizes
  python -m benchmarks --only reader,latency    # re-measure two; other sections are kept
  python -m benchmarks --scratch /mnt/nvme/tmp  # measure another filesystem
  make bench BENCH_ARGS="--only write"

Every ratio compares configurations measured in the same run, interleaved (A B A B ...),
so machine drift affects both sides. Progress goes to stderr; results to
OUT/benchmarks.md (tables and findings) and OUT/benchmarks.json (raw numbers).
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure the hidden-state connector and reader against their baselines "
        "and this machine's limits; write a markdown report and raw JSON.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and counts: a smoke run (about 1.5 min on an idle 2-core machine)",
    )
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        help=f"run only these benchmarks ({', '.join(BENCHMARKS)}); results of the others "
        "already in OUT are kept",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs",
        help="where benchmarks.md and benchmarks.json go (default: docs/)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=Path(tempfile.gettempdir()) / "hidden-state-bench",
        help="working directory on the filesystem to measure (default: %(default)s); "
        "tiny models are cached in SCRATCH/models",
    )
    args = parser.parse_args(argv)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
        args.names = [n for n in BENCHMARKS if n in names]
    else:
        args.names = list(BENCHMARKS)
    return args


def _run_info(
    args: argparse.Namespace, argv: list[str] | None, mode: str, started: float
) -> dict[str, Any]:
    """The run's header for the JSON: command, start time, machine, versions, load."""
    return {
        "mode": mode,
        "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": machine(args.scratch),
        "versions": versions(),
        "busy_processes_at_start": busy_processes(),
    }


def _run_one(
    name: str, ctx: Context, mode: str, other: OtherLoad, cores: int
) -> tuple[dict[str, Any], bool]:
    """Run benchmark ``name``; return its result (with timing and load) and whether it failed."""
    module = importlib.import_module(f"benchmarks.{name}")
    log(f"== {module.TITLE}")
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    other_start = other.read()
    failed = False
    try:
        result = module.run(ctx)
    except Exception as exc:
        log(f"{name} FAILED: {exc!r}")
        result = {"error": "".join(traceback.format_exception(exc))[-4000:], "goals": []}
        failed = True
    result["seconds"] = time.perf_counter() - t0
    result["loadavg_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    # Share of the machine's CPU time that other processes took while this ran.
    result["other_cpu_share"] = (other.read() - other_start) / (result["seconds"] * cores)
    result["mode"] = mode
    result["measured"] = time.strftime("%Y-%m-%d %H:%M")
    log(f"{name}: done in {result['seconds']:.0f} s")
    return result, failed


def _merge_doc(
    args: argparse.Namespace, json_path: Path, run_info: dict[str, Any], results: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: this run's results over what earlier ``--only`` runs kept."""
    doc: dict[str, Any] = {"schema": 1, "run": run_info, "benchmarks": {}}
    if args.only and json_path.exists():
        # Keep what earlier runs measured for the benchmarks not run now.
        try:
            old = json.loads(json_path.read_text())
            doc["benchmarks"] = dict(old.get("benchmarks", {}))
            doc["previous_runs"] = [old.get("run", {}), *old.get("previous_runs", [])][:5]
        except (OSError, ValueError):
            pass
    doc["benchmarks"].update(results)
    doc["benchmarks"] = {n: doc["benchmarks"][n] for n in BENCHMARKS if n in doc["benchmarks"]}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(quick=args.quick, scratch=args.scratch, cache=args.scratch / "models")
    ctx.cache.mkdir(exist_ok=True)
    mode = "quick" if args.quick else "full"
    log(f"{mode} run of {', '.join(args.names)}; scratch {args.scratch}, output {args.out}")
    started = time.time()
    run_info = _run_info(args, argv, mode, started)
    results: dict[str, Any] = {}
    failed = []
    other = OtherLoad()
    cores = os.cpu_count() or 1
    for name in args.names:
        results[name], did_fail = _run_one(name, ctx, mode, other, cores)
        if did_fail:
            failed.append(name)
    other.stop()
    run_info["seconds"] = time.time() - started
    run_info["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    run_info["busy_processes_at_end"] = busy_processes()
    run_info["benchmarks_run"] = args.names

    json_path = args.out / "benchmarks.json"
    doc = _merge_doc(args, json_path, run_info, results)
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md_path = args.out / "benchmarks.md"
    md_path.write_text(render_markdown(doc))
    log(f"wrote {md_path} and {json_path} ({run_info['seconds'] / 60:.1f} min)")
    if failed:
        log(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
