"""Forked DataLoader workers after ``HiddenStateLoader(device="cuda")`` do not abort (issue 38).

    PYTHONPATH=packages/reader/src:packages/connector/src python3 benchmarks/gpu/fork_check.py
    ... fork_check.py --samples 64 --epochs 2 --no-control
    ... fork_check.py --device cpu     # the script's own dry run, on a machine without a GPU

Seen on an H100: after epochs of ``HiddenStateLoader(..., device="cuda")``, a plain
``DataLoader`` whose workers were forked lost one to "CUDA error: initialization error"
(from ``ExchangeDevice``), killed by SIGABRT. A forked child cannot use CUDA, yet freeing
a page-locked buffer that a non-blocking copy read, a ``record_stream``ed device tensor or
a recorded ``torch.cuda.Event`` calls CUDA, from a destructor (which aborts on error).
A DataLoader worker's garbage collector frees the reference cycles it inherited, and a
finished device feed was one, holding its page-locked buffers and their copy events.

Phases, each ending in ``DataLoader(range(64), num_workers=2,
multiprocessing_context="fork")`` run to the end:

* ``as_reported``: 2 epochs on the device, the loader kept, the collector left alone.
* ``loader_dropped``: the same passes in a function that drops its loader.
* ``batch_in_cycle``: a delivered batch left in a reference cycle.
* ``control`` (run first, not counted in ``ok``; ``--no-control`` skips it): no project
  code yet, a page-locked tensor a non-blocking copy read, left in a cycle. It should
  abort its worker: the mechanism itself, on this machine's torch and driver. (Once a
  device feed was made, the parent collects before each fork: ``training/fork_safety.py``.)

In all but the first, this process collects no garbage by itself until the loop is over
and every worker collects once when it starts (what its collector does sooner or later),
so the outcome does not depend on the collector's timing.

One JSON line after ``RESULT ``: ok, error (the first failing phase's, with its workers'
last stderr lines), phases, control_aborted, torch, python, gpu. Exit status 1 unless
ok. The code before the fix runs the same script with PYTHONPATH at an older checkout
(commit 686378a).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

STDERR_TAIL = 1500  # characters of the workers' stderr kept in a failing phase's error


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="small samples to write")
    parser.add_argument("--epochs", type=int, default=2, help="device passes per phase")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--no-control", action="store_true", help="skip the control phase")
    return parser.parse_args()


def write_samples(root: Path, count: int) -> None:
    """``count`` bf16 samples of 16-63 tokens, 2 layers of 256, written by the product."""
    from hidden_state_reader.files.publish import write_sample
    from hidden_state_reader.format import sample_metadata

    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        tokens = 16 + i % 48
        hidden = torch.randn(tokens, 2, 256, generator=gen).to(torch.bfloat16)
        meta = sample_metadata(layer_ids=[0, 1], request_id=f"r{i}")
        write_sample(root / f"hs_{i:03d}.safetensors", torch.arange(tokens), hidden, metadata=meta)


def device_passes(root: Path, epochs: int, device: str) -> tuple[Any, Any]:
    """``epochs`` passes of a device loader (packed batches built in its page-locked buffers)."""
    from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, PackCollate

    dataset = HiddenStateDataset(root, shuffle=True)
    loader = HiddenStateLoader(dataset, 8, collate_fn=PackCollate(), device=device, num_workers=2)
    batch = None
    for _ in range(epochs):
        for batch in loader:
            batch["hidden_states"].float().sum()  # the training step's stand-in
    if device == "cuda":
        torch.cuda.synchronize()
    return loader, batch


def _collect(_worker_id: int) -> None:
    gc.collect()


def forked_loop(collect: bool) -> None:
    """A plain DataLoader with forked workers, run to the end (they collect first if asked)."""
    loader = DataLoader(
        range(64),
        batch_size=8,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_collect if collect else None,
        timeout=120,
    )
    seen = sorted(int(i) for batch in loader for i in batch)
    if seen != list(range(64)):
        raise RuntimeError(f"the forked workers gave {len(seen)} items, not 0..63")


@contextlib.contextmanager
def stderr_kept(into: list[str]) -> Iterator[None]:
    """File descriptor 2 (this process's and its workers') into a file, then echoed."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            sys.stderr.write(text)
            into.append(text)


def phase(run: Callable[[], None], quiet_collector: bool) -> dict[str, Any]:
    """``run()``'s outcome: ok, or the error and the last of what the workers printed."""
    printed: list[str] = []
    if quiet_collector:
        gc.collect()
        gc.disable()
    try:
        with stderr_kept(printed):
            run()
        result: dict[str, Any] = {"ok": True, "error": None}
    except Exception as exc:  # reported, and the next phase still runs
        tail = "".join(printed)[-STDERR_TAIL:]
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{tail}".strip()}
    finally:
        gc.enable()
        gc.collect()
    return result


def phases(root: Path, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """The phases to run, by name, in order."""

    def as_reported() -> None:
        loader, _ = device_passes(root, args.epochs, args.device)
        forked_loop(collect=False)
        del loader

    def loader_dropped() -> None:
        device_passes(root, args.epochs, args.device)  # loader and last batch dropped
        forked_loop(collect=True)

    def batch_in_cycle() -> None:
        loader, batch = device_passes(root, args.epochs, args.device)
        cycle: list[Any] = [batch]
        cycle.append(cycle)
        del batch, cycle
        forked_loop(collect=True)
        del loader

    def control() -> None:
        pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        cycle: list[Any] = [pinned]
        cycle.append(cycle)
        del pinned, cycle
        forked_loop(collect=True)

    # The control first: before any device feed, nothing collects before a fork yet.
    chosen: dict[str, Callable[[], None]] = {}
    if not args.no_control and args.device == "cuda":
        chosen["control"] = control
    chosen.update(as_reported=as_reported, loader_dropped=loader_dropped)
    chosen["batch_in_cycle"] = batch_in_cycle
    return chosen


def main() -> int:
    args = parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fork-check-") as tmp:
        root = Path(tmp)
        write_samples(root, args.samples)
        for name, run in phases(root, args).items():
            print(f"phase {name}", flush=True)  # where a crash of this process happened
            results[name] = phase(run, quiet_collector=name != "as_reported")
            print(f"phase {name}: ok={results[name]['ok']}", flush=True)
    counted = {name: r for name, r in results.items() if name != "control"}
    failed = [r["error"] for r in counted.values() if not r["ok"]]
    control = results.get("control")
    cuda = args.device == "cuda" and torch.cuda.is_available()
    summary = {
        "kind": "fork_check",
        "ok": not failed,
        "error": failed[0] if failed else None,
        "phases": results,
        "control_aborted": None if control is None else not control["ok"],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }
    print("RESULT " + json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
