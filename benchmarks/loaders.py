"""Loading one file: the reader's loader vs safetensors' ``load_file`` and ``safe_open``.

The reader parses and checks the safetensors header itself and loads a sample with one
``preadv`` into one buffer, or (files of 1 MiB or more with ``format_version``) maps it
``MAP_PRIVATE``; the tensors are views into that buffer. This benchmark loads the same
files (written by ``write_sample``) with:

* ``reader load_sample``: ``hidden_state_reader.load_sample(path)`` (its defaults).
* ``reader load_sample, mmap=False``: every file read into fresh memory.
* ``safetensors load_file``: ``safetensors.torch.load_file(path)``.
* ``safetensors safe_open``: ``safe_open(path, "pt")`` and ``get_tensor`` per tensor.

Each pass loads every file and touches every byte (``benchmarks.reader.touch``); warm
page cache, passes interleaved. It also shows what each does with a file cut short (a
writer died mid-file, or a reader raced a writer that does not publish by rename).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Context, fmt, gb, log, median, rotate, table
from benchmarks.reader import make_dataset, touch

NAME = "loaders"
TITLE = "13. Loading a file: the reader's loader vs safetensors'"


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.glob("*.safetensors"))


def _reader(paths: list[str], mmap: bool = True) -> None:
    from hidden_state_reader import LoadOptions, load_sample

    options = LoadOptions(mmap=mmap)
    for path in paths:
        sample = load_sample(path, options)
        touch(sample.token_ids)
        touch(sample.hidden_states)


def _reader_copy(paths: list[str]) -> None:
    _reader(paths, mmap=False)


def _load_file(paths: list[str]) -> None:
    from safetensors.torch import load_file

    for path in paths:
        for tensor in load_file(path).values():
            touch(tensor)


def _safe_open(paths: list[str]) -> None:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                touch(f.get_tensor(key))


METHODS: dict[str, Callable[[list[str]], None]] = {
    "reader load_sample": _reader,
    "reader load_sample, mmap=False": _reader_copy,
    "safetensors load_file": _load_file,
    "safetensors safe_open": _safe_open,
}


def _measure(paths: list[str], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for method in METHODS.values():
        method(paths)  # warm the page cache and the code
    for r in range(rounds):
        for name in rotate(list(METHODS), r):
            t0 = time.perf_counter()
            METHODS[name](paths)
            times[name].append(time.perf_counter() - t0)
    return {m: median(t) for m, t in times.items()}


def _truncated(root: Path) -> dict[str, str]:
    """What each loader says about a file cut in the middle of its tensor data."""
    source = _files(root)[0]
    cut = str(root / "cut.safetensors")
    with open(source, "rb") as f:
        data = f.read()
    with open(cut, "wb") as f:
        f.write(data[: len(data) - (len(data) // 4)])
    said = {}
    for name, method in METHODS.items():
        try:
            method([cut])
            said[name] = "loaded without error"
        except Exception as exc:  # what users see is the point
            said[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
    os.unlink(cut)
    return said


def run(ctx: Context) -> dict[str, Any]:
    rounds = ctx.pick(3, 7)
    sets = {
        "small": (ctx.pick(200, 2000), [16], 3, 256),
        "large": (ctx.pick(4, 16), [ctx.pick(256, 1024)], 4, 4096),
    }
    rows = []
    said: dict[str, str] = {}
    for label, (count, lengths, layers, hidden) in sets.items():
        root = ctx.workdir(f"loaders-{label}")
        nbytes = make_dataset(root, lengths * count, layers, hidden)
        paths = _files(root)
        times = _measure(paths, rounds)
        for method, seconds in times.items():
            rows.append(
                {
                    "files": label,
                    "count": count,
                    "tokens": lengths[0],
                    "layers": layers,
                    "hidden": hidden,
                    "method": method,
                    "files_per_s": count / seconds,
                    "gb_per_s": gb(nbytes) / seconds,
                    "vs_reader": seconds / times["reader load_sample"],
                }
            )
        log(f"{NAME}: {label}: " + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in times.items()))
        if label == "large":
            said = _truncated(root)
        ctx.workdir(f"loaders-{label}")  # empty it again
    return {"setup": {"rounds": rounds}, "rows": rows, "truncated": said, "goals": []}


def findings(res: dict[str, Any]) -> list[str]:
    by = {(r["files"], r["method"]): r for r in res["rows"]}
    small_lf = by[("small", "safetensors load_file")]["vs_reader"]
    large_lf = by[("large", "safetensors load_file")]["vs_reader"]
    return [
        "Loading: `safetensors.torch.load_file` takes "
        f"{fmt(small_lf)}\u00d7 the reader's time on small files and {fmt(large_lf)}\u00d7 on "
        "large ones (every byte touched, warm cache); the reader also needs what safetensors "
        "does not do: the lock protocol, refusing a partial file with a typed error that names "
        "it, and tensors that keep their mapping alive (so it stays the loader; safetensors is "
        "used by the tests and benchmarks to check files against an independent reader)."
    ]


def render(res: dict[str, Any]) -> str:
    rows = res["rows"]
    return "\n".join(
        [
            f"Median of {res['setup']['rounds']} interleaved warm passes; every byte touched.",
            "",
            table(
                ["files", "method", "files/s", "GB/s", "time \u00f7 reader's"],
                [
                    [
                        f"{r['files']}: {r['count']} \u00d7 {r['tokens']} tokens \u00d7 "
                        f"{r['layers']} layers \u00d7 {r['hidden']}",
                        r["method"],
                        r["files_per_s"],
                        r["gb_per_s"],
                        r["vs_reader"],
                    ]
                    for r in rows
                ],
            ),
            "",
            "A large file cut short by a quarter:",
            "",
            table(["method", "says"], [[m, f"`{s}`"] for m, s in res["truncated"].items()]),
        ]
    )
