"""Reader throughput: ``HiddenStateReader`` vs a raw read loop and the loops users write today.

Every method reads the same files in the same order and hands each to a consumer that
touches every byte (an integer sum over the tensors' bytes):

* ``reader``: ``for s in HiddenStateReader(dir)`` (snapshot mode: list, lock, validate, load).
* ``raw``: ``open``/``fstat``/``preadv`` into one buffer/``close`` per file, no lock, no
  validation: the ceiling for a Python loop.
* ``naive flock``: ``flock(LOCK_SH)`` on the lock file, then
  ``safetensors.torch.load_file`` (vLLM's ``load_hidden_states``).
* ``naive poll``: ``flock(LOCK_EX | LOCK_NB)`` retried every 100 ms, then ``load_file``
  (the speculators-style loop).

Reference rows that explain the numbers (no goal attached): the raw loop into one reused
buffer (the cost of fresh memory), two prototypes of a faster ``load_fd`` (map the file;
map large files and read small ones in one call), and the reader in a process with torch's
huge-page allocator (``THP_MEM_ALLOC_ENABLE=1``, full mode only).

Warm: the files are in the page cache. Cold: the page cache is dropped before every pass
(``echo 3 > /proc/sys/vm/drop_caches``; needs root). Passes are interleaved, the order
rotating each round.
"""

from __future__ import annotations

import cProfile
import fcntl
import io
import os
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Context,
    drop_caches,
    fmt,
    goal,
    log,
    median,
    rotate,
    spread,
    table,
)

NAME = "reader"
TITLE = "3. Reader throughput (samples/s and GB/s to a consumer touching every byte)"
GOAL_RAW = 0.8
GOAL_NAIVE = 1.0
METHODS = (
    "reader",
    "raw",
    "naive flock",
    "naive poll",
    "raw, one reused buffer",
    "mmap load (proposed)",
    "mmap \u2265 1 MiB, else one read (proposed)",
    "reader, THP_MEM_ALLOC_ENABLE=1",
)
# Rows that explain the others; no goal is attached to them.
REFERENCE = METHODS[4:]


def touch(tensor: Any) -> int:
    """Read every byte of ``tensor``: a wrapping sum of its bytes as 64-bit words.

    numpy's uint64 sum runs at memory speed here (~12 GB/s); torch's integer sums on
    this CPU build are 5-20x slower and would drown the differences being measured.
    """
    import numpy as np
    import torch

    data = tensor.reshape(-1).view(torch.uint8).numpy()
    if data.size % 8 == 0:
        return int(data.view(np.uint64).sum())
    return int(data.sum())


def make_dataset(directory: Path, lengths: list[int], layers: int, hidden: int) -> int:
    """Write one sample per length with the package's writer; return tensor bytes."""
    import torch

    from hidden_state_reader import write_sample

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    longest = max(lengths) * layers * hidden
    pool = torch.randn(longest + 4096, generator=gen).to(torch.bfloat16)
    total = 0
    for i, n in enumerate(lengths):
        offset = (i * 977) % 4096
        hidden_states = pool[offset : offset + n * layers * hidden].view(n, layers, hidden)
        token_ids = torch.arange(n, dtype=torch.int64) % 250
        write_sample(directory / f"hs_{i}.safetensors", token_ids, hidden_states)
        total += n * 8 + hidden_states.numel() * 2
    return total


def _names(root: Path) -> list[str]:
    from hidden_state_reader.format import natural_key

    return sorted((n for n in os.listdir(root) if n.endswith(".safetensors")), key=natural_key)


def pass_reader(root: Path) -> int:
    from hidden_state_reader import HiddenStateReader

    n = 0
    for token_ids, hidden_states in HiddenStateReader(root, on_error="raise"):
        touch(token_ids)
        touch(hidden_states)
        n += 1
    return n


def pass_raw(root: Path) -> int:
    import torch

    n = 0
    for name in _names(root):
        fd = os.open(root / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            buf = torch.empty(size, dtype=torch.uint8)
            view = buf.numpy().data.cast("B")
            done = 0
            while done < size:
                done += os.preadv(fd, [view[done:]], done)
        finally:
            os.close(fd)
        touch(buf)
        n += 1
    return n


def pass_raw_reused(root: Path) -> int:
    """Like ``raw`` but into one buffer reused for every file: no fresh memory to fault in.

    Not a usable loader (each sample is overwritten by the next); it shows what the
    allocation of a fresh buffer per sample costs.
    """
    import torch

    n = 0
    buf = torch.empty(0, dtype=torch.uint8)
    for name in _names(root):
        fd = os.open(root / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if buf.numel() < size:
                buf = torch.empty(size, dtype=torch.uint8)
            view = buf[:size].numpy().data.cast("B")
            done = 0
            while done < size:
                done += os.preadv(fd, [view[done:]], done)
        finally:
            os.close(fd)
        touch(buf[:size])
        n += 1
    return n


def pass_mmap_load(root: Path) -> int:
    """A prototype of loading by ``mmap`` instead of ``preadv`` into fresh memory.

    Same lock and header validation as the reader (``SharedLock``, ``read_header_fd``),
    then the file is mapped copy-on-write and the tensors are views of the mapping, as
    ``safetensors.torch.load_file`` does: no copy, no fresh anonymous memory to fault in.
    """
    import mmap

    import torch

    from hidden_state_reader.format import SharedLock, read_header_fd

    n = 0
    for name in _names(root):
        path = str(root / name)
        with SharedLock.acquire(path) as _lock:  # type: ignore[union-attr]
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                header = read_header_fd(fd, path)
                mapping = mmap.mmap(
                    fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            finally:
                os.close(fd)
        data = torch.frombuffer(mapping, dtype=torch.uint8)[header.data_start :]
        tokens = data[header.tokens.begin : header.tokens.end].view(torch.int64)
        hidden = data[header.hidden.begin : header.hidden.end].view(header.hidden_dtype)
        touch(tokens)
        touch(hidden.view(header.hidden.shape))
        n += 1
    return n


MMAP_MIN_BYTES = 1 << 20


def pass_proposed_load(root: Path) -> int:
    """A prototype of the proposed ``load_fd``: map large files, read small ones in one go.

    Files of at least ``MMAP_MIN_BYTES`` are mapped as in ``pass_mmap_load``. Smaller
    files are read whole with one ``preadv`` (instead of three reads: length prefix,
    header, data) and the header is validated from that buffer with the package's
    ``parse_header``. Lock handling and validation are the reader's.
    """
    import mmap
    import struct

    import torch

    from hidden_state_reader.format import SharedLock, read_header_fd
    from hidden_state_reader.format.header import parse_header

    n = 0
    for name in _names(root):
        path = str(root / name)
        with SharedLock.acquire(path) as _lock:  # type: ignore[union-attr]
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size >= MMAP_MIN_BYTES:
                    header = read_header_fd(fd, path)
                    mapping = mmap.mmap(
                        fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                    )
                    whole = torch.frombuffer(mapping, dtype=torch.uint8)
                else:
                    whole = torch.empty(size, dtype=torch.uint8)
                    view = whole.numpy().data.cast("B")
                    done = 0
                    while done < size:
                        done += os.preadv(fd, [view[done:]], done)
                    (length,) = struct.unpack_from("<Q", view, 0)
                    header = parse_header(path, bytes(view[8 : 8 + length]), size)
            finally:
                os.close(fd)
        data = whole[header.data_start :]
        tokens = data[header.tokens.begin : header.tokens.end].view(torch.int64)
        hidden = data[header.hidden.begin : header.hidden.end].view(header.hidden_dtype)
        touch(tokens)
        touch(hidden.view(header.hidden.shape))
        n += 1
    return n


def pass_naive_flock(root: Path) -> int:
    from safetensors.torch import load_file

    n = 0
    for name in _names(root):
        path = str(root / name)
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            data = load_file(path, device="cpu")
        touch(data["token_ids"])
        touch(data["hidden_states"])
        n += 1
    return n


def pass_naive_poll(root: Path) -> int:
    from safetensors.torch import load_file

    n = 0
    for name in _names(root):
        path = str(root / name)
        with open(path + ".lock") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.1)
            data = load_file(path, device="cpu")
        touch(data["token_ids"])
        touch(data["hidden_states"])
        n += 1
    return n


def pass_reader_thp(root: Path) -> tuple[int, float]:
    """The ``reader`` pass in a fresh process with torch's huge-page allocator switched on.

    ``THP_MEM_ALLOC_ENABLE=1`` makes torch's CPU allocator ask for transparent huge pages
    for large buffers (``madvise``), so a fresh sample buffer faults in 2 MiB at a time
    instead of 4 KiB. Returns the count and the pass time measured in that process.
    """
    import subprocess

    from benchmarks.common import child_env, python_module

    proc = subprocess.run(
        python_module("benchmarks.reader", "pass", str(root)),
        env=child_env(THP_MEM_ALLOC_ENABLE="1"),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    n, seconds = proc.stdout.split()
    return int(n), float(seconds)


PASSES: dict[str, Callable[[Path], Any]] = {
    "reader": pass_reader,
    "raw": pass_raw,
    "naive flock": pass_naive_flock,
    "naive poll": pass_naive_poll,
    "raw, one reused buffer": pass_raw_reused,
    "mmap load (proposed)": pass_mmap_load,
    "mmap \u2265 1 MiB, else one read (proposed)": pass_proposed_load,
    "reader, THP_MEM_ALLOC_ENABLE=1": pass_reader_thp,
}


def _profile(root: Path, top: int = 10) -> list[dict[str, Any]]:
    """cProfile of one warm ``reader`` pass: the functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    pass_reader(root)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({func})",
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:top]


def _measure(
    root: Path, rounds: int, cold: bool, label: str, methods: tuple[str, ...]
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in methods}
    expected = len(_names(root))
    for r in range(rounds):
        for method in rotate(list(methods), r):
            if cold:
                err = drop_caches()
                if err:
                    raise PermissionError(err)
            t = time.perf_counter()
            n = PASSES[method](root)
            dt = time.perf_counter() - t
            if isinstance(n, tuple):  # timed in a subprocess
                n, dt = n
            if n != expected:
                raise RuntimeError(f"{method} read {n} of {expected} samples")
            times[method].append(dt)
        log(
            f"reader: {label} round {r + 1}/{rounds}: "
            + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in methods)
        )
    return times


def run(ctx: Context) -> dict[str, Any]:
    work = ctx.workdir("reader")
    datasets = {
        "large": {
            "lengths": [256, 512, 1024, 2048] * ctx.pick(2, 8),
            "layers": 4,
            "hidden": 4096,
        },
        "small": {"lengths": [16] * ctx.pick(100, 2000), "layers": 4, "hidden": 1024},
    }
    # The huge-page row runs in a subprocess per pass (seconds of start-up): full mode only.
    methods = METHODS[:-1] if ctx.quick else METHODS
    warm_rounds = ctx.pick(1, 5)
    cold_rounds = ctx.pick(1, 3)
    result: dict[str, Any] = {"datasets": {}, "goals": []}
    cold_refused = None
    for name, spec in datasets.items():
        root = work / name
        log(f"reader: writing the {name} dataset ({len(spec['lengths'])} files)")
        nbytes = make_dataset(root, spec["lengths"], spec["layers"], spec["hidden"])
        count = len(spec["lengths"])
        file_bytes = sum(os.path.getsize(root / n) for n in _names(root))
        pass_reader(root)  # warm the page cache
        warm = _measure(root, warm_rounds, cold=False, label=f"{name} warm", methods=methods)
        cold: dict[str, list[float]] | None = None
        if cold_refused is None:
            try:
                cold = _measure(root, cold_rounds, cold=True, label=f"{name} cold", methods=methods)
            except PermissionError as exc:
                cold_refused = str(exc)
                log(f"reader: cannot drop the page cache ({exc}); cold runs skipped")
        entry: dict[str, Any] = {
            "files": count,
            "tensor_bytes": nbytes,
            "file_bytes": file_bytes,
            "layers": spec["layers"],
            "hidden": spec["hidden"],
            "token_lengths": sorted(set(spec["lengths"])),
            "profile_reader_warm": _profile(root),
        }
        for cond, times in (("warm", warm), ("cold", cold)):
            if times is None:
                continue
            entry[cond] = {
                m: {
                    "seconds": spread(ts),
                    "samples_s": count / median(ts),
                    "gb_s": nbytes / median(ts) / 1e9,
                }
                for m, ts in times.items()
            }
            ratios = {
                other: median([b / a for a, b in zip(times["reader"], times[other], strict=True)])
                for other in methods[1:]
            }
            entry[cond + "_ratios"] = ratios
            result["goals"].append(
                goal(f"reader ({name} files, {cond}) / raw loop", ratios["raw"], GOAL_RAW)
            )
            naive = min(ratios["naive flock"], ratios["naive poll"])
            result["goals"].append(
                goal(f"reader ({name} files, {cond}) / faster naive loop", naive, GOAL_NAIVE)
            )
        result["datasets"][name] = entry
    result["cold_refused"] = cold_refused
    result["rounds"] = {"warm": warm_rounds, "cold": cold_rounds}
    return result


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    out = []
    for name, d in res["datasets"].items():
        parts = []
        for cond in ("warm", "cold"):
            if cond not in d:
                continue
            r = d[cond + "_ratios"]
            naive = min(r["naive flock"], r["naive poll"])
            parts.append(
                f"{cond}: {d[cond]['reader']['gb_s']:.2f} GB/s, {r['raw']:.2f}\u00d7 raw "
                f"(goal 0.8 {'met' if r['raw'] >= GOAL_RAW else 'missed'}), {naive:.2f}\u00d7 "
                f"the faster naive loop (goal 1 {'met' if naive >= GOAL_NAIVE else 'missed'})"
            )
        out.append(
            f"**Reader, {name} files** ({d['file_bytes'] / d['files'] / 2**20:.2f} MiB each): "
            + "; ".join(parts)
            + "."
        )
    large = res["datasets"].get("large", {})
    warm = large.get("warm", {})
    if "mmap load (proposed)" in warm and "naive flock" in warm:
        r = large["warm_ratios"]
        text = (
            "Why the naive loops win on large files with a warm cache: "
            "`safetensors.torch.load_file` maps the file (`mmap`) and the tensors point into "
            "the page cache, so nothing is copied; the reader `preadv`s every sample into a "
            "freshly allocated buffer, and on this VM the kernel's copy into fresh "
            "(not yet faulted-in) memory runs at "
            f"{warm['raw']['gb_s']:.1f} GB/s (the raw loop does the same and is no faster). "
            f"Reading into one reused buffer reaches {warm['raw, one reused buffer']['gb_s']:.1f} "
            "GB/s: most of the cost is faulting in fresh pages. A prototype that keeps the "
            "reader's lock and header validation but maps the file instead of copying "
            f"(`mmap load (proposed)` in `benchmarks/reader.py`) delivers "
            f"{warm['mmap load (proposed)']['gb_s']:.1f} GB/s, "
            f"{1 / r['mmap load (proposed)']:.1f}\u00d7 the reader"
        )
        if "reader, THP_MEM_ALLOC_ENABLE=1" in warm:
            thp = warm["reader, THP_MEM_ALLOC_ENABLE=1"]["gb_s"]
            text += (
                f"; the unchanged reader with torch's huge-page allocator "
                f"(`THP_MEM_ALLOC_ENABLE=1`) {thp:.1f} GB/s"
            )
        out.append(text + ".")
    cold = large.get("cold", {})
    if "mmap load (proposed)" in cold:
        out.append(
            f"Cold cache, large files: reader {cold['reader']['gb_s']:.2f} GB/s, raw "
            f"{cold['raw']['gb_s']:.2f}, naive flock {cold['naive flock']['gb_s']:.2f}, mmap "
            f"prototype {cold['mmap load (proposed)']['gb_s']:.2f} GB/s."
        )
    combined = "mmap \u2265 1 MiB, else one read (proposed)"
    parts = []
    for name, d in res["datasets"].items():
        for cond in ("warm", "cold"):
            rows = d.get(cond, {})
            if combined in rows:
                speedup = 1 / d[cond + "_ratios"][combined]
                vs_raw = rows[combined]["gb_s"] / rows["raw"]["gb_s"]
                parts.append(
                    f"{name} {cond} {rows[combined]['gb_s']:.2f} GB/s ({speedup:.2f}\u00d7 the "
                    f"reader, {vs_raw:.2f}\u00d7 raw)"
                )
    if parts:
        out.append(
            "The proposed `load_fd` (prototype `mmap \u2265 1 MiB, else one read`: map files of "
            "1 MiB or more, read smaller ones whole with one `preadv` and validate the header "
            "from that buffer; same locking and validation): " + "; ".join(parts) + ". For the "
            "large files it runs the same code as `mmap load (proposed)`, so the difference "
            "between those two rows is this machine's noise."
        )
    small = res["datasets"].get("small", {})
    if small.get("warm"):
        prof = small.get("profile_reader_warm") or []
        top = ", ".join(f"`{p['function']}` {p['tottime_s'] * 1e3:.1f} ms" for p in prof[:3])
        out.append(
            f"Small files ({small['files']} per pass): the reader's per-file work (lock "
            "file open + `flock`, header read and validation, two `open`s instead of one) "
            f"is what separates it from the raw loop; profile top: {top}."
        )
    return out


def render(res: dict[str, Any]) -> str:
    out = []
    if res.get("cold_refused"):
        refused = res["cold_refused"]
        out += [f"Cold runs skipped: dropping the page cache was refused ({refused}).", ""]
    for name, d in res["datasets"].items():
        lengths = d["token_lengths"]
        out += [
            f"**{name} files**: {d['files']} samples of {', '.join(map(str, lengths))} "
            f"tokens \u00d7 {d['layers']} layers \u00d7 {d['hidden']} hidden (bf16), "
            f"{d['tensor_bytes'] / 1e9:.2f} GB of tensors "
            f"({d['file_bytes'] / d['files'] / 2**20:.2f} MiB per file on average). "
            f"{res['rounds']['warm']} warm and {res['rounds']['cold']} cold rounds. GB/s and "
            "samples/s come from the median pass time; the reader's speed-up is the median of "
            "per-round ratios (each round times every method once, in rotating order). Rows "
            "below the naive loops are references (no goal): see the findings.",
            "",
        ]
        rows = []
        for cond in ("warm", "cold"):
            if cond not in d:
                continue
            ratios = d[cond + "_ratios"]
            for method in METHODS:
                if method not in d[cond]:
                    continue
                m = d[cond][method]
                s = m["seconds"]
                rows.append(
                    [
                        cond,
                        method,
                        m["samples_s"],
                        m["gb_s"],
                        f"{fmt(s['median'])} ({fmt(s['min'])}\u2013{fmt(s['max'])})",
                        1.0 if method == "reader" else ratios[method],
                    ]
                )
        out.append(
            table(
                [
                    "cache",
                    "method",
                    "samples/s",
                    "GB/s",
                    "s per pass (min\u2013max)",
                    "reader's speed \u00f7 this method's",
                ],
                rows,
            )
        )
        prof = d.get("profile_reader_warm") or []
        if prof:
            out += [
                "",
                f"cProfile of one warm `reader` pass over the {name} files (own time; "
                "profiling slows Python code, not the kernel's copies):",
                "",
                table(
                    ["function", "calls", "own s", "cumulative s"],
                    [[p["function"], p["calls"], p["tottime_s"], p["cumtime_s"]] for p in prof],
                ),
            ]
        out.append("")
    return "\n".join(out).rstrip()


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "pass":
        import numpy  # noqa: F401 - imports and the first huge-page fault out of the timing
        import torch

        import hidden_state_reader  # noqa: F401

        torch.empty(64 * 2**20, dtype=torch.uint8).fill_(0)
        start = time.perf_counter()
        count = pass_reader(Path(sys.argv[2]))
        print(count, time.perf_counter() - start)
    else:
        raise SystemExit("usage: python -m benchmarks.reader pass DIR (internal)")
