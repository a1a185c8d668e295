"""Samples/s and GB/s through the Mooncake Store vs the file path, on this machine.

    python -m benchmarks.store [--quick] [--json OUT]

Re-runs itself in a loopback-only network namespace (needs root) with a real
``mooncake_master`` and a separate segment host (``mooncake_client``). Store path:
this process publishes staged sample files (``StorePublisher``: put data, put commit
record), then a second process reads them all with ``HiddenStateReader("mooncake://...")``
(get, size and CRC32 check, load). File path: ``write_sample`` with a CRC32 into a
directory, then a second process reads it with ``HiddenStateReader(dir,
verify_checksum=True)``. The files live in the page cache: both paths are measured
from memory, which is the fair comparison for a store that lives in memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MASTER = "127.0.0.1:50051"
URL = f"mooncake://{MASTER}/bench?hostname=127.0.0.1&buffer=128MiB"


def _sizes(quick: bool) -> tuple[int, int]:
    # (samples, tokens) of [tokens, 4 layers, 1024] bf16: 8 KiB per token.
    return (16, 512) if quick else (48, 2048)


def _stage(root: Path, count: int, tokens: int) -> tuple[list[Path], float]:
    """Write ``count`` samples; their paths and the seconds the writes took."""
    import torch

    from hidden_state_reader.format import sample_metadata, write_sample

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
    total = 0
    for sample in reader:
        total += sample.nbytes  # verify_checksum: every byte was read and CRC-checked
    print(json.dumps({"seconds": time.perf_counter() - started, "bytes": total,
                      "samples": reader.stats.yielded}))  # fmt: skip


def _reader(source: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.store", "--read", source],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def _start_store(logs: Path) -> list[subprocess.Popen[bytes]]:
    binary = Path(sys.executable).parent
    master = _daemon([str(binary / "mooncake_master"), "--rpc_address=127.0.0.1",
                      "--rpc_port=50051"], logs / "master.log")  # fmt: skip
    host = _daemon([str(binary / "mooncake_client"), "--global_segment_size=2GB",
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


def _inside(quick: bool) -> dict:
    count, tokens = _sizes(quick)
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    procs = _start_store(work)
    try:
        _, files_write = _stage(work / "files", count, tokens)
        files_read = _reader(str(work / "files"))
        staged, _ = _stage(work / "staged", count, tokens)
        store_write = _store_write(staged)
        store_read = _reader(URL)
    finally:
        for proc in procs:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    size = files_read["bytes"]

    def rate(seconds: float) -> dict:
        return {"samples_per_s": round(count / seconds, 1),
                "GB_per_s": round(size / seconds / 1e9, 3)}  # fmt: skip

    return {
        "samples": count, "sample_MB": round(size / count / 1e6, 2),
        "files": {"write": rate(files_write), "read": rate(files_read["seconds"])},
        "store": {"write": rate(store_write), "read": rate(store_read["seconds"])},
        "store_read_samples": store_read["samples"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--read", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        return _read_child(args.read)
    if not args.inside:
        argv = [sys.executable, "-m", "benchmarks.store", "--inside"]
        argv += ["--quick"] if args.quick else []
        cmd = "ip link set lo up && exec " + " ".join(argv)
        out = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    print(json.dumps(_inside(args.quick)))


if __name__ == "__main__":
    main()
