"""A forked child never frees what the device feed registered (``fork_guard``).

On a GPU, freeing a page-locked buffer a copy read, a ``record_stream``ed tensor or a
CUDA event calls CUDA, which aborts a forked child (a DataLoader worker). CI has no GPU:
these tests fork for real and watch, through weak references reported over a pipe,
which objects a child's garbage collector frees; the CUDA side is
``benchmarks/gpu/fork_check.py``.
"""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata
from hidden_state_reader.training.collate import PackCollate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.device_feed import DeviceFeed, HostArenas
from hidden_state_reader.training.fork_guard import keep_in_forked_children
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import make_tensors

CHILD_TIMEOUT = 60.0  # seconds: a child that has not answered by then is stuck


@contextmanager
def no_automatic_collection() -> Iterator[None]:
    """Garbage stays until collected by hand (as it may, for long, in a real process)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def in_forked_child(report: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``report()`` run in a child forked now; its answer, and how the child exited."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave as a DataLoader worker does (os._exit)
        code = 0
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(report()).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], CHILD_TIMEOUT)
        if not ready:
            os.kill(pid, 9)
        answer = os.read(read_end, 65536) if ready else b""
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert ready, f"the forked child did not answer within {CHILD_TIMEOUT} s"
    assert os.waitstatus_to_exitcode(status) == 0, status
    return dict(json.loads(answer))


def test_a_forked_child_collects_inherited_garbage_but_frees_nothing_registered() -> None:
    with no_automatic_collection():
        kept, other = torch.empty(1 << 16, dtype=torch.uint8), torch.empty(1 << 16)
        keep_in_forked_children(kept)
        kept_storage = weakref.ref(kept.untyped_storage())
        other_storage = weakref.ref(other.untyped_storage())
        cycle: list[Any] = [kept[8:16], other]  # a view is enough to hold the memory
        cycle.append(cycle)  # garbage in a reference cycle, as a finished feed once was
        del kept, other, cycle
        assert kept_storage() is not None and other_storage() is not None

        def report() -> dict[str, Any]:
            gc.collect()  # what a DataLoader worker's collector does sooner or later
            keep_in_forked_children(torch.empty(4))  # the registry's lock is free here
            return {"kept": kept_storage() is not None, "other": other_storage() is not None}

        assert in_forked_child(report) == {"kept": True, "other": False}
        gc.collect()  # in this process the registration keeps nothing alive
        assert kept_storage() is None and other_storage() is None


def test_host_buffers_outlive_a_forked_childs_collection() -> None:
    with no_automatic_collection():
        arenas = HostArenas(2, pin=False)
        batch = arenas.allocate([("a", (4, 8), torch.bfloat16)])
        arenas.copied(None)
        buffer = weakref.ref(batch["a"].untyped_storage())
        owner: list[Any] = [arenas]
        owner.append(owner)
        del arenas, batch, owner

        def report() -> dict[str, Any]:
            gc.collect()
            return {"buffer": buffer() is not None}

        assert in_forked_child(report) == {"buffer": True}
        gc.collect()
        assert buffer() is None


def test_registering_while_other_threads_fork_never_leaves_the_registry_locked() -> None:
    stop = threading.Event()

    def register() -> None:
        while not stop.is_set():
            keep_in_forked_children(torch.empty(8))

    def report() -> dict[str, Any]:
        keep_in_forked_children(torch.empty(8))  # would wait forever on a lock left held
        return {"registered": True}

    threads = [threading.Thread(target=register) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(5):
            assert in_forked_child(report) == {"registered": True}
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def write(root: Path, count: int) -> None:
    for i in range(count):
        tokens, hidden = make_tensors(i, tokens=3 + i % 5, layers=2, hidden=8)
        meta = sample_metadata(layer_ids=[0, 1])
        write_sample(root / f"hs_{i}.safetensors", tokens, hidden, metadata=meta)


def test_a_finished_or_abandoned_device_pass_leaves_no_feed_for_the_collector(
    hs_dir: Path,
) -> None:
    write(hs_dir, 12)
    with no_automatic_collection():
        loader = HiddenStateLoader(
            HiddenStateDataset(hs_dir), 4, collate_fn=PackCollate(), device="cpu", num_workers=2
        )
        for _ in range(2):
            assert sum(len(batch["paths"]) for batch in loader) == 12
        batches = iter(loader)
        next(batches)
        batches.close()  # a loop that broke out
        del loader, batches
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, (DeviceFeed, HostArenas))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []


def test_forked_dataloader_workers_run_after_device_passes(hs_dir: Path) -> None:
    write(hs_dir, 8)
    loader = HiddenStateLoader(HiddenStateDataset(hs_dir), 4, device="cpu", num_workers=2)
    for _ in range(2):
        assert sum(len(batch["paths"]) for batch in loader) == 8
    plain = DataLoader(
        range(64),
        batch_size=8,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=lambda _: gc.collect(),
    )
    assert sorted(int(i) for batch in plain for i in batch) == list(range(64))


def test_the_gpu_checks_dry_run_passes_on_the_cpu() -> None:
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, str(repo / "benchmarks/gpu/fork_check.py"), "--device", "cpu",
         "--samples", "16"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["ok"] and set(result["phases"]) == {
        "as_reported", "loader_dropped", "batch_in_cycle"
    }  # fmt: skip
