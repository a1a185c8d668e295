"""A forked child inherits no garbage from the device feed (``training/fork_safety.py``).

On a GPU, a forked DataLoader worker that frees a page-locked buffer, a ``record_stream``ed
tensor or a CUDA event aborts (reproduced on an H100: ``benchmarks/gpu/fork_check.py``).
A child frees only the garbage it inherited. These tests fork for real and watch,
through weak references reported over a pipe, what a child could still free: nothing
the feed made (a finished feed is no reference cycle), and no garbage of any code (the
parent collects before each fork once a device feed was made).
"""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata
from hidden_state_reader.training.collate import PackCollate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.device_feed.builder_threads import DeviceFeed
from hidden_state_reader.training.device_feed.device_finishing import DeviceFinishing
from hidden_state_reader.training.device_feed.host_build import HostArenas, HostBuild
from hidden_state_reader.training.device_feed.to_device import ToDevice
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import make_tensors

# What the device feed makes: the feed and its stages (``training/device_feed/``).
FEED_OBJECTS = (DeviceFeed, HostArenas, HostBuild, ToDevice, DeviceFinishing)
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
    """``report()`` run in a child forked now; its answer (the child must exit 0)."""
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


def write(root: Path, count: int) -> None:
    for i in range(count):
        tokens, hidden = make_tensors(i, tokens=3 + i % 5, layers=2, hidden=8)
        meta = sample_metadata(layer_ids=[0, 1])
        write_sample(root / f"hs_{i}.safetensors", tokens, hidden, metadata=meta)


class _Node:
    """Something that can sit in a reference cycle and be weakly referenced."""

    other: Any = None


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
            left = [o for o in gc.garbage if isinstance(o, FEED_OBJECTS)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []


def test_after_a_device_pass_a_forked_child_inherits_no_garbage(hs_dir: Path) -> None:
    """Garbage made before a fork is freed by the parent, not left for the child to free."""
    write(hs_dir, 4)
    loader = HiddenStateLoader(HiddenStateDataset(hs_dir), 2, device="cpu", num_workers=1)
    assert sum(len(batch["paths"]) for batch in loader) == 4
    with no_automatic_collection():
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        watched = weakref.ref(a)
        del a, b
        assert watched() is not None  # garbage, still there: nobody collected
        seen = in_forked_child(lambda: {"inherited": watched() is not None})
        assert seen == {"inherited": False}
        assert watched() is None  # the parent freed it, before the fork


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
    script = str(repo / "benchmarks/gpu/fork_check.py")
    out = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--samples", "16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["ok"], result
    assert set(result["phases"]) == {"as_reported", "loader_dropped", "batch_in_cycle"}
