"""Every answered request becomes a complete file, with no further engine step.

A real offline ``LLM`` script (``tests/tools/offline_delivery.py``) in each engine
mode: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which stops stepping as soon as
its outputs are done) and multiprocess. After each batch the script sends nothing more
and sleeps on the locks until the files are published; its last batch is followed by
the end of the script, and the files must be there once the process has gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import probe
from hidden_state_reader.format import LockState, lock_path

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "offline_delivery.py"
SLEEP_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "offline_sleep.py"


@pytest.mark.parametrize(
    ("multiprocessing", "executor"),
    [("0", "uni"), ("0", "mp"), ("1", "")],
    ids=["in-process", "in-process-worker-process", "multiprocess"],
)
def test_answered_requests_are_published_without_further_requests_and_at_exit(
    multiprocessing: str, executor: str, tiny_model_fp32: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hs"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing, "EXECUTOR": executor}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_model_fp32), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    reports = {r["batch"]: r for r in map(json.loads, lines)}
    for batch in ("prompt", "output"):
        report = reports[batch]
        print(f"{batch}: published {report['published']} in {report['waited_s']} s")
        assert report["missing"] == [], f"{batch}: never published without a further step"
        assert report["published"] == len(report["paths"])
    if "blocks" in reports:  # in-process: the scheduler is in the script's process
        print(f"KV blocks still held after the batches: {reports['blocks']['held']}")
        # Only the last one-prompt batch (20 tokens, block size 16) may still hold its
        # blocks (main model and hidden-state groups); every earlier request freed its.
        assert 0 <= reports["blocks"]["held"] <= 4
    # After the process ended: every answered request of the last batch is complete.
    at_exit = reports["at-exit"]["paths"]
    names = [os.path.basename(p) for p in at_exit]
    samples = {str(s.path): s for s in HiddenStateReader(out, names=names, on_error="raise")}
    assert sorted(samples) == sorted(at_exit)
    prompt_lengths = [20, 21, 22, 23]
    stored_outputs = [0, 0, 4, 4]  # two prompt-only; two with 5 generated, the last unfed
    for path, length, extra in zip(at_exit, prompt_lengths, stored_outputs, strict=True):
        assert samples[path].num_tokens == length + extra
    every = [p for r in reports.values() for p in r["paths"]]
    assert all(probe(lock_path(p)) is LockState.FREE for p in every)
    assert not [f for f in os.listdir(out) if ".tmp." in f]


@pytest.mark.parametrize(
    "multiprocessing",
    ["1", pytest.param("0", marks=pytest.mark.long)],
    ids=["multiprocess", "in-process"],
)
def test_sleep_right_after_generate_loses_no_answered_sample(
    multiprocessing: str, tiny_model_fp32: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hs"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    done = subprocess.run(
        [sys.executable, str(SLEEP_SCRIPT), str(tiny_model_fp32), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    report = json.loads(line)
    if multiprocessing == "1":
        # The engine core's pause steps until the connector has reported its blocks free.
        assert report["slept"] == [0, 1] and report["failed"] == []
    else:
        # An in-process engine does not step in its pause: vLLM refuses to reset the cache
        # while the connector holds the batch's blocks, and releases nothing.
        assert report["slept"] == [] and len(report["failed"]) == 2
        assert all("Failed to reset KV cache" in reason for reason in report["failed"])
    names = [os.path.basename(p) for p in report["paths"]]
    samples = {str(s.path): s for s in HiddenStateReader(out, names=names, on_error="raise")}
    assert sorted(samples) == sorted(report["paths"])
    lengths = [samples[p].num_tokens for p in report["paths"]]
    assert lengths == [100 + i for i in range(6)] * 2  # every answered prompt, complete
