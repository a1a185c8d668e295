"""Reader throughput: ``HiddenStateReader`` vs a raw read loop and the loops users write today.

Every method reads the same files in the same order and hands each to a consumer that
touches every byte (an integer sum over the tensors' bytes):

* ``reader``: ``for s in HiddenStateReader(dir)`` (snapshot mode: list, lock, validate, load).
  Files of 1 MiB or more that carry ``format_version`` metadata are mapped
  (``MAP_PRIVATE``); smaller ones are read into a fresh buffer with one ``preadv``, and
  without their lock (published by rename: ``docs/format.md``).
* ``raw``: ``open``/``fstat``/``preadv`` into one buffer/``close`` per file, no lock, no
  validation: the ceiling for a Python loop. Its consumer touches the same two tensors'
  bytes the reader's consumer touches (token ids, then hidden states), found by
  arithmetic from the file's length prefix and the dataset's row size (no header parsed
  per file): both loops hand the consumer the same work, so the ratio compares reading.
* ``naive flock``: ``flock(LOCK_SH)`` on the lock file, then
  ``safetensors.torch.load_file`` (vLLM's ``load_hidden_states``).
* ``naive poll``: ``flock(LOCK_EX | LOCK_NB)`` retried every 100 ms, then ``load_file``
  (the speculators-style loop).

Reference rows that explain the numbers (no goal attached): the raw loop into one reused
buffer (the same reads without fresh memory), the raw loop whose consumer touches the
whole buffer in one call (header bytes too; this was ``raw`` until 2026-12-04: on small
files one consumer call fewer per file is a visible share of the time) and the reader
with ``mmap=False`` (every file copied into fresh memory: the path taken with
``pin_memory=True`` and for files without ``format_version``).

The datasets are written with the package's ``write_sample``, as the connector writes
them (``format_version`` set, published by rename), so the reader maps the large files.

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
    naive_poll_load,
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
    "raw, whole buffer touched once",
    "reader, mmap=False",
)
# Rows that explain the others; no goal is attached to them.
REFERENCE = ("raw, one reused buffer", "raw, whole buffer touched once", "reader, mmap=False")


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


def pass_reader(root: Path, mmap: bool = True) -> int:
    from hidden_state_reader import HiddenStateReader

    n = 0
    for token_ids, hidden_states in HiddenStateReader(root, on_error="raise", mmap=mmap):
        touch(token_ids)
        touch(hidden_states)
        n += 1
    return n


def pass_reader_copy(root: Path) -> int:
    """The ``reader`` pass with ``mmap=False``: every file is copied into fresh memory."""
    return pass_reader(root, mmap=False)


def mapped_files(root: Path) -> int:
    """How many files of ``root`` the reader maps (by default) rather than copies.

    The same test as ``hidden_state_reader.sample.load``: at least ``MMAP_MIN_BYTES`` and a
    ``format_version`` in the metadata (this project's writers set it).
    """
    from hidden_state_reader import read_header
    from hidden_state_reader.format.header import Meta
    from hidden_state_reader.sample.load import MMAP_MIN_BYTES

    n = 0
    for name in _names(root):
        header = read_header(root / name)
        if header.file_size >= MMAP_MIN_BYTES and Meta.FORMAT in header.metadata:
            n += 1
    return n


def _raw_read(path: Path) -> tuple[Any, memoryview]:
    """The whole file in a fresh ``uint8`` tensor (and a byte view of it): ``open``/``fstat``/
    ``preadv``/``close``."""
    import torch

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        buf = torch.empty(size, dtype=torch.uint8)
        view = buf.numpy().data.cast("B")
        done = 0
        while done < size:
            done += os.preadv(fd, [view[done:]], done)
    finally:
        os.close(fd)
    return buf, view


def _row_bytes(root: Path) -> int:
    """Bytes per token of the dataset's files: an int64 token id and its hidden-state row."""
    from hidden_state_reader import read_header

    header = read_header(root / _names(root)[0])
    return header.tokens.nbytes // header.num_tokens + header.hidden.nbytes // header.num_tokens


def pass_raw(root: Path) -> int:
    """The raw loop; its consumer gets the token ids' and hidden states' bytes, as the reader's."""
    row = _row_bytes(root)  # once per pass: the dataset's shape, as a raw loop would know it
    n = 0
    for name in _names(root):
        buf, view = _raw_read(root / name)
        start = 8 + int.from_bytes(view[:8], "little")  # the header's length prefix
        split = start + 8 * ((buf.numel() - start) // row)
        touch(buf[start:split])
        touch(buf[split:])
        n += 1
    return n


def pass_raw_whole(root: Path) -> int:
    """The raw loop, its consumer touching the whole buffer (header too) in one call."""
    n = 0
    for name in _names(root):
        touch(_raw_read(root / name)[0])
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
    n = 0
    for name in _names(root):
        data = naive_poll_load(str(root / name), 0.1)
        touch(data["token_ids"])
        touch(data["hidden_states"])
        n += 1
    return n


PASSES: dict[str, Callable[[Path], Any]] = {
    "reader": pass_reader,
    "raw": pass_raw,
    "naive flock": pass_naive_flock,
    "naive poll": pass_naive_poll,
    "raw, one reused buffer": pass_raw_reused,
    "raw, whole buffer touched once": pass_raw_whole,
    "reader, mmap=False": pass_reader_copy,
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
            if n != expected:
                raise RuntimeError(f"{method} read {n} of {expected} samples")
            times[method].append(dt)
        log(
            f"reader: {label} round {r + 1}/{rounds}: "
            + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in methods)
        )
    return times


def _add_condition(
    entry: dict[str, Any],
    name: str,
    cond: str,
    times: dict[str, list[float]],
    count: int,
    nbytes: int,
    methods: tuple[str, ...],
) -> list[dict[str, Any]]:
    """Store one cache condition's speeds and ratios in ``entry``; return its goals."""
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
    naive = min(ratios["naive flock"], ratios["naive poll"])
    return [
        goal(f"reader ({name} files, {cond}) / raw loop", ratios["raw"], GOAL_RAW),
        goal(f"reader ({name} files, {cond}) / faster naive loop", naive, GOAL_NAIVE),
    ]


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
    methods = METHODS
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
            "mapped_files": mapped_files(root),
            "layers": spec["layers"],
            "hidden": spec["hidden"],
            "token_lengths": sorted(set(spec["lengths"])),
            "profile_reader_warm": _profile(root),
        }
        for cond, times in (("warm", warm), ("cold", cold)):
            if times is None:
                continue
            result["goals"] += _add_condition(entry, name, cond, times, count, nbytes, methods)
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
        mapped = d.get("mapped_files")
        mapped_text = "" if mapped is None else f"; the reader maps {mapped} of {d['files']}"
        out.append(
            f"**Reader, {name} files** ({d['file_bytes'] / d['files'] / 2**20:.2f} MiB per "
            f"file on average{mapped_text}): " + "; ".join(parts) + "."
        )
    large = res["datasets"].get("large", {})
    for cond in ("warm", "cold"):
        rows = large.get(cond, {})
        if not all(m in rows for m in METHODS):
            continue
        r = large[cond + "_ratios"]
        gb = {m: rows[m]["gb_s"] for m in METHODS}
        out.append(
            f"Large files, {cond} cache, GB/s: reader {gb['reader']:.2f} (maps the files), "
            f"naive flock {gb['naive flock']:.2f} (`safetensors.torch.load_file`, also maps), "
            f"raw {gb['raw']:.2f} (`preadv` into a fresh buffer per file), raw into one reused "
            f"buffer {gb['raw, one reused buffer']:.2f}, reader with `mmap=False` "
            f"{gb['reader, mmap=False']:.2f} (copies into a fresh buffer per file). The reader "
            f"is {r['reader, mmap=False']:.2f}\u00d7 as fast as its own copy path; the two raw "
            f"rows differ only in fresh memory: "
            f"{gb['raw, one reused buffer'] / gb['raw']:.2f}\u00d7."
        )
    small = res["datasets"].get("small", {})
    if small.get("warm"):
        rows = small["warm"]
        prof = small.get("profile_reader_warm") or []
        top = ", ".join(f"`{p['function']}` {p['tottime_s'] * 1e3:.1f} ms" for p in prof[:3])
        copy = ""
        if "reader, mmap=False" in rows:
            copy = f", reader with `mmap=False` {rows['reader, mmap=False']['gb_s']:.2f}"
        out.append(
            f"Small files, warm cache, GB/s: reader {rows['reader']['gb_s']:.2f}, raw "
            f"{rows['raw']['gb_s']:.2f}{copy}; per file {1e6 / rows['reader']['samples_s']:.0f} "
            f"\u00b5s against the raw loop's {1e6 / rows['raw']['samples_s']:.0f} \u00b5s. A "
            "snapshot reads a small file of this project's writers with `open`, `lseek`, one "
            "`preadv` and `close`, without its lock (published by rename, the file is final "
            "once complete: docs/format.md), checks a header whose tensor layout it has "
            "validated before only for its metadata and size (`kernels/layouts.py`), and makes "
            f"each tensor with one `np.ndarray` and one `from_numpy`; profile top: {top}. "
            "What is left is Python per sample (stream, policy, header, `Sample`) and the "
            "consumer's second `touch`: it touches two tensors where the raw loop touches "
            "one buffer."
        )
    return out


def _dataset_intro(res: dict[str, Any], name: str, d: dict[str, Any]) -> str:
    """The paragraph that describes one dataset and how it was measured."""
    lengths = d["token_lengths"]
    return (
        f"**{name} files**: {d['files']} samples of {', '.join(map(str, lengths))} "
        f"tokens \u00d7 {d['layers']} layers \u00d7 {d['hidden']} hidden (bf16), "
        f"{d['tensor_bytes'] / 1e9:.2f} GB of tensors "
        f"({d['file_bytes'] / d['files'] / 2**20:.2f} MiB per file on average). "
        f"{res['rounds']['warm']} warm and {res['rounds']['cold']} cold rounds. GB/s and "
        "samples/s come from the median pass time; the reader's speed-up is the median of "
        "per-round ratios (each round times every method once, in rotating order). Rows "
        "below the naive loops are references (no goal): see the findings."
    )


def _dataset_table(d: dict[str, Any]) -> str:
    """One dataset's table: every method under every cache condition measured."""
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
    return table(
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


def render(res: dict[str, Any]) -> str:
    out = []
    if res.get("cold_refused"):
        refused = res["cold_refused"]
        out += [f"Cold runs skipped: dropping the page cache was refused ({refused}).", ""]
    for name, d in res["datasets"].items():
        out += [_dataset_intro(res, name, d), ""]
        out.append(_dataset_table(d))
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
