"""Samples/s and GB/s through the Mooncake Store vs the file path, on this machine.

    python -m benchmarks --only store [--quick]      # a section of docs/benchmarks.md
    python -m benchmarks.store [--quick] [--json OUT] # this benchmark alone
    python -m benchmarks.store --paths   # one sample's read path, before and now, in turns

Re-runs itself in a loopback-only network namespace (needs root and ``unshare``) with a
real ``mooncake_master`` and a separate segment host (``mooncake_client``). Store path:
this process publishes staged sample files (``StorePublisher``: put data, put commit
record), then a second process reads them all with ``HiddenStateReader("mooncake://...")``
(get, size and CRC32 check, load). File path: ``write_sample`` with a CRC32 into a
directory, then a second process reads it with ``HiddenStateReader(dir,
verify_checksum=True)``. The files live in the page cache: both paths are measured
from memory, which is the fair comparison for a store that lives in memory. The store's
own limit is measured beside them: a third process that only ``get_into``s the same
objects, one after another, into one registered buffer (no check, no load). The three
reads take turns, ``READ_ROUNDS`` times (medians): the machine is shared. Where the
namespace or Mooncake is not available the section records why and measures nothing.

Full mode also measures the vLLM server ratio with the Mooncake backend
(``benchmarks.store_engine``): prompt tokens/s of a vLLM CPU engine writing to the store
vs the same engine writing files, until every sample is published, in the same namespace.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "store"
TITLE = "10. Mooncake Store vs files (samples/s, GB/s)"
MASTER = "127.0.0.1:50051"
URL = f"mooncake://{MASTER}/bench?hostname=127.0.0.1&buffer=128MiB"
BIN = Path(sys.executable).parent
ENGINE_ROUNDS = (5, 16, 512)  # full mode: rounds per backend, prompts per round, tokens
READ_ROUNDS = 3  # full mode: files, raw store, store reader, in turn


def _sizes(quick: bool) -> tuple[int, int]:
    # (samples, tokens) of [tokens, 4 layers, 1024] bf16: 8 KiB per token.
    return (4, 256) if quick else (48, 2048)


def unavailable() -> str | None:
    """Why the store cannot be measured here (None: it can)."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine(-non-cuda) is not installed (make install adds it)"
    if not (BIN / "mooncake_master").exists() or not (BIN / "mooncake_client").exists():
        return f"mooncake_master / mooncake_client are not in {BIN}"
    if not shutil.which("unshare") or os.geteuid() != 0:
        return "needs root and unshare for a loopback-only network namespace"
    return None


def _stage(root: Path, count: int, tokens: int) -> tuple[list[Path], float]:
    """Write ``count`` samples; their paths and the seconds the writes took."""
    import torch

    from hidden_state_reader.files.publish import write_sample
    from hidden_state_reader.format import sample_metadata

    root.mkdir(parents=True, exist_ok=True)
    hidden = [torch.randn(tokens, 4, 1024).bfloat16() for _ in range(count)]
    meta = sample_metadata(layer_ids=[1, 2, 3, 4])
    paths = [root / f"b-{i:04d}.safetensors" for i in range(count)]
    started = time.perf_counter()
    for path, states in zip(paths, hidden, strict=True):
        write_sample(path, torch.arange(tokens), states, use_lock=False, checksum=True,
                     metadata=meta)  # fmt: skip
    return paths, time.perf_counter() - started


def _read_child(source: str) -> None:
    from hidden_state_reader import HiddenStateReader

    started = time.perf_counter()
    reader = HiddenStateReader(source, verify_checksum=True)
    total = first = 0
    for sample in reader:
        total += sample.nbytes  # verify_checksum: every byte was read and CRC-checked
        if not first:
            first, after_first = sample.nbytes, time.perf_counter()
    end = time.perf_counter()
    steady = (total - first) / max(end - after_first, 1e-9)
    print(json.dumps({"seconds": end - started, "bytes": total, "samples": reader.stats.yielded,
                      "steady_B_per_s": steady}))  # fmt: skip


def _raw_child(source: str) -> None:
    """``get_into`` every sample of the store, in order, into one registered buffer."""
    import numpy as np

    from hidden_state_reader.format.store_keys import data_key
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.follow import CommitLog
    from hidden_state_reader.store.url import parse_store_url

    client = StoreClient(parse_store_url(source))
    log, records = CommitLog(client, hole_grace=60), []  # what the reader reads
    while batch := log.poll():
        records += [record for _, record in batch]
    keys = [data_key(client.settings.prefix, r.name) for r in records]
    size = max(r.size for r in records)
    buf = np.empty(size, dtype=np.uint8)
    client.raw_store.register_buffer(buf.ctypes.data, size)
    started, total = time.perf_counter(), 0
    for key in keys:
        total += client.raw_store.get_into(key, buf.ctypes.data, size)
    end = time.perf_counter()
    print(json.dumps({"seconds": end - started, "bytes": total, "samples": len(keys),
                      "steady_B_per_s": total / (end - started)}))  # fmt: skip


def _reader(source: str, how: str = "--read") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.store", how, source],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _paths(samples: int = 40) -> dict[str, Any]:
    """One sample's read path, before and now, taking turns sample by sample (``--paths``).

    Run inside the namespace with a store up: 4 objects of 32 MiB, then per turn a raw
    ``get_into`` and each variant reading the next object; per variant the median GB/s
    and the median over turns of its rate over the raw one of the same turn. "before" is
    the read path this release replaced (a size query, ``get_into`` a staging buffer, a
    copy into fresh memory, ``load_buffer`` with zlib's CRC); "now (X)" is
    ``StoreClient.get_object``, ``check_bytes`` with CRC implementation X, and
    ``load_checked`` (no read-ahead: one sample at a time).
    """
    import numpy as np

    from benchmarks.common import median
    from hidden_state_reader.kernels import crc, host_memory
    from hidden_state_reader.options import LoadOptions
    from hidden_state_reader.sample.load import load_buffer
    from hidden_state_reader.store import load
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.url import parse_store_url

    client = StoreClient(parse_store_url(URL.replace("128MiB", "256MiB")))
    store = client.raw_store
    files, _ = _stage(Path(tempfile.mkdtemp(prefix="bench-paths-")), 4, 4096)
    keys = [f"paths-{i}" for i in range(len(files))]
    for key, path in zip(keys, files, strict=True):
        client.put(key, path.read_bytes())
    shutil.rmtree(files[0].parent, ignore_errors=True)
    size = max(client.size(k) or 0 for k in keys)
    staging = np.empty(size, dtype=np.uint8)
    store.register_buffer(staging.ctypes.data, size)

    def raw(key: str) -> None:
        store.get_into(key, staging.ctypes.data, size)

    def before(key: str) -> None:
        n = client.size(key) or 0
        out = host_memory.empty_bytes(n)
        store.get_into(key, staging.ctypes.data, n)
        np.copyto(out, staging[:n])
        load_buffer(key, out, LoadOptions(verify_checksum=True))

    def now(function: crc.Crc32) -> Any:
        def read(key: str) -> None:
            data = client.get_object(key, size)
            assert data is not None
            load.check_bytes(key, data, None, crc=function)  # this variant's CRC
            load.load_checked(key, data, LoadOptions())

        return read

    variants = {"raw": raw, "before": before}
    variants.update({f"now ({name})": now(f) for name, f in crc.implementations().items()})
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(samples):
        for name, read in variants.items():
            started = time.perf_counter()
            read(keys[i % len(keys)])
            seconds[name].append(time.perf_counter() - started)
    return {name: {"GB_per_s": size / median(ts) / 1e9,
                   "over_raw": median([r / t for r, t in zip(seconds["raw"], ts, strict=True)])}
            for name, ts in seconds.items()}  # fmt: skip


def _store_write(paths: list[Path]) -> float:
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.publish import StorePublisher, publish_file
    from hidden_state_reader.store.url import parse_store_url

    publisher = StorePublisher(StoreClient(parse_store_url(URL)))
    staged = [Path(shutil.copy(p, p.with_suffix(".staged"))) for p in paths]
    started = time.perf_counter()
    for path, copy in zip(paths, staged, strict=True):
        publish_file(publisher, path.name, str(copy))
    return time.perf_counter() - started


def _daemon(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _start_store(logs: Path, segment: str) -> list[subprocess.Popen[bytes]]:
    master = _daemon([str(BIN / "mooncake_master"), "--rpc_address=127.0.0.1",
                      "--rpc_port=50051"], logs / "master.log")  # fmt: skip
    host = _daemon([str(BIN / "mooncake_client"), f"--global_segment_size={segment}",
                    f"--master_server_address={MASTER}", "--metadata_server=P2PHANDSHAKE",
                    "--host=127.0.0.1", "--port=50060"], logs / "host.log")  # fmt: skip
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.url import parse_store_url

    deadline = time.monotonic() + 30
    while True:  # ready once a put succeeds
        try:
            StoreClient(parse_store_url(URL)).put("bench-probe", b"x", full_timeout=20)
            return [master, host]
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _inside(quick: bool, scratch: Path, model: Path | None) -> dict[str, Any]:
    count, tokens = _sizes(quick)
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=scratch))
    procs = _start_store(work, "256MB" if quick else "2GB")
    try:
        _, files_write = _stage(work / "files", count, tokens)
        staged, _ = _stage(work / "staged", count, tokens)
        store_write = _store_write(staged)
        reads: dict[str, list[dict[str, Any]]] = {"files": [], "raw": [], "store": []}
        for _ in range(1 if quick else READ_ROUNDS):
            reads["files"].append(_reader(str(work / "files")))
            reads["raw"].append(_reader(URL, "--raw"))
            reads["store"].append(_reader(URL))
        engines = None if model is None else _engines(model, work / "vllm")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    size = reads["files"][0]["bytes"]

    def rate(seconds: float) -> dict[str, float]:
        return {"samples_per_s": count / seconds, "GB_per_s": size / seconds / 1e9}

    def read(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**rate(median([r["seconds"] for r in runs])),
                "steady_GB_per_s": median([r["steady_B_per_s"] for r in runs]) / 1e9,
                "steady_GB_per_s_each": [r["steady_B_per_s"] / 1e9 for r in runs]}  # fmt: skip

    from benchmarks.common import median
    from hidden_state_reader.kernels.crc import chosen

    store_read, raw_read = read(reads["store"]), read(reads["raw"])
    return {
        "samples": count, "tokens": tokens, "sample_MB": size / count / 1e6,
        "files": {"write": rate(files_write), "read": read(reads["files"])},
        "store": {"write": rate(store_write), "read": store_read},
        "raw_get_into": {"read": raw_read},
        # Per round, the store reader over the raw get_into of the same round.
        "store_over_raw": median([s["steady_B_per_s"] / r["steady_B_per_s"]
                                  for s, r in zip(reads["store"], reads["raw"], strict=True)]),
        "store_read_samples": reads["store"][-1]["samples"],
        "crc32": chosen()[0],
        **({} if engines is None else {"vllm": engines}),
    }  # fmt: skip


def _engines(model: Path, work: Path) -> dict[str, Any]:
    from benchmarks.store_engine import measure as measure_engines

    work.mkdir()
    rounds, count, length = ENGINE_ROUNDS
    return measure_engines(model, work, MASTER, rounds, count, length)


def measure(quick: bool, scratch: Path, model: Path | None = None) -> dict[str, Any]:
    """The measurement, run in a fresh loopback-only namespace (``{"skipped": why}`` if not).

    Args:
        quick: Few small samples, no vLLM.
        scratch: Where the sample files go.
        model: The tiny model the vLLM engines serve (None: no engines).
    """
    why = unavailable()
    if why is not None:
        return {"skipped": why}
    scratch.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "benchmarks.store", "--inside", "--scratch", str(scratch)]
    argv += ["--quick"] if quick else []
    argv += [] if model is None else ["--model", str(model)]
    cmd = "ip link set lo up && exec " + " ".join(argv)
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    tail: collections.deque[str] = collections.deque(maxlen=40)
    for line in proc.stderr:  # progress lines pass through (engine rounds take minutes)
        tail.append(line)
        if line.startswith("[bench"):
            sys.stderr.write(line)
    out = proc.stdout.read()  # one JSON line: it cannot fill the pipe meanwhile
    if proc.wait():
        raise RuntimeError(f"the store benchmark failed: {''.join(tail)[-2000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def _model(ctx: Any) -> Path | None:
    """The engines' tiny model in full mode, built outside the namespace (None: quick)."""
    if ctx.quick or unavailable() is not None:
        return None
    from benchmarks.common import bench_model
    from benchmarks.store_engine import MODEL

    ctx.cache.mkdir(parents=True, exist_ok=True)
    return bench_model(ctx, MODEL)


def run(ctx: Any) -> dict[str, Any]:
    from benchmarks.common import log

    res = measure(ctx.quick, ctx.workdir(NAME), _model(ctx))
    if "skipped" in res:
        log(f"store: skipped ({res['skipped']})")
    else:
        log("store: read " + ", ".join(f"{k} {res[k]['read']['steady_GB_per_s']:.2f} GB/s"
                                       for k in ("files", "store", "raw_get_into")))  # fmt: skip
    res["goals"] = []  # no target: the store's cost is reported, not judged
    return res


_PATHS = {
    "files": "Files (`write_sample` with CRC, then `HiddenStateReader(dir, verify_checksum=True)`)",
    "store": "Store (put of a staged file + commit record, then "
    '`HiddenStateReader("mooncake://...")`)',
    "raw_get_into": "Store, raw: `get_into` each object into one registered buffer "
    "(no check, no load): the store's limit",
}


_HEADER = ["path", "write samples/s", "write GB/s", "read samples/s", "read GB/s",
           "read GB/s after the first sample"]  # fmt: skip


def render(res: dict[str, Any]) -> str:
    from benchmarks.common import fmt, table
    from benchmarks.store_engine import render_engines

    if "skipped" in res:
        return table(["measured", "why not"], [["no", res["skipped"]]])
    rows = []
    for k in ("files", "store", "raw_get_into"):
        write, read = res[k].get("write"), res[k]["read"]
        each = ", ".join(fmt(x) for x in read["steady_GB_per_s_each"])
        rows.append([_PATHS[k], write["samples_per_s"] if write else "-",
                     write["GB_per_s"] if write else "-", read["samples_per_s"],
                     read["GB_per_s"], f"{fmt(read['steady_GB_per_s'])} ({each})"])  # fmt: skip
    return "\n".join([
        f"{res['samples']} samples of {res['sample_MB']:.1f} MB ({res['tokens']} tokens x 4 "
        "layers x 1024, bf16), loopback TCP, writer and reader in separate processes, both "
        "paths CRC-checked, files in the page cache. The store's write column times the "
        "put alone (the connector first writes the file into tmpfs with the same code). "
        "Reads: the median of the rounds (files, raw store, store in turn); the read "
        "columns time the whole pass, process set-up included (joining the store), the "
        "last one the rate after the first sample, each round in brackets. "
        f"Store reader / raw `get_into` (per round, median): {res['store_over_raw']:.2f}; "
        f"CRC32 by `{res['crc32']}`.",
        "",
        table(_HEADER, rows),
        *(["", render_engines(res["vllm"])] if "vllm" in res else []),
    ])  # fmt: skip


def findings(res: dict[str, Any]) -> list[str]:
    from benchmarks.store_engine import engine_finding

    if "skipped" in res:
        return [f"Mooncake Store: not measured ({res['skipped']})"]
    f, s = res["files"], res["store"]
    return [
        f"Mooncake Store over loopback: read {s['read']['steady_GB_per_s']:.2f} GB/s per "
        f"reader process ({res['store_over_raw']:.2f}x a raw get_into loop) vs "
        f"{f['read']['steady_GB_per_s']:.2f} GB/s from cached files; put "
        f"{s['write']['GB_per_s']:.2f} GB/s vs write_sample {f['write']['GB_per_s']:.2f} GB/s"
        + (f"; {engine_finding(res['vllm'])}" if "vllm" in res else "")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python -m benchmarks.store --quick --json /tmp/store.json",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a few small samples (seconds)")
    parser.add_argument("--json", default="", help="also write the result here")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the sample files go (default: %(default)s)")  # fmt: skip
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--read", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raw", default="", help=argparse.SUPPRESS)
    parser.add_argument("--paths", action="store_true",
                        help="time one sample's read path, before and now, in turns")  # fmt: skip
    parser.add_argument("--paths-inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        return _read_child(args.read)
    if args.raw:
        return _raw_child(args.raw)
    if args.inside:
        print(json.dumps(_inside(args.quick, args.scratch, args.model)))
        return
    if args.paths_inside:
        procs = _start_store(Path(tempfile.mkdtemp(prefix="bench-paths-logs-")), "2GB")
        try:
            print(json.dumps(_paths()))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        return
    if args.paths:  # the same, in a loopback-only namespace of its own
        cmd = f"ip link set lo up && exec {sys.executable} -m benchmarks.store --paths-inside"
        out = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True,
                             text=True, check=True)  # fmt: skip
        print(json.dumps(json.loads(out.stdout.strip().splitlines()[-1]), indent=1))
        return
    from benchmarks.common import Context

    ctx = Context(quick=args.quick, scratch=args.scratch, cache=args.scratch / "models")
    result = measure(args.quick, args.scratch, _model(ctx))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
