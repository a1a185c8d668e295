"""Every script in examples/ runs as a user would run it, and says what it should.

Each example is started as a subprocess with small sizes (the DDP one through
``torch.distributed.run``, as torchrun does) and its exit status and key output lines are
checked. ``test_every_example_is_run`` fails when a script is added to examples/ without
a test here: register the test with ``@runs("name.py")``. Every example also needs a
module docstring with "What it shows" and "Run it" sections and an ``example:`` in its
``--help``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from procs import IN_PROCESS_ENGINE

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_BY: dict[str, str] = {}
"""Example script -> the test that runs it."""

ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def runs(script: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test as the one that runs ``examples/<script>``."""

    def register(test: Callable[..., Any]) -> Callable[..., Any]:
        assert script not in RUN_BY, f"{script} is run by {RUN_BY[script]} already"
        RUN_BY[script] = test.__name__
        return test

    return register


def example(
    script: str,
    *args: str,
    timeout: float = 120,
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script> ARGS``; fail with its output if it exits non-zero."""
    cmd = [*(launcher or [sys.executable]), str(EXAMPLES / script), *args]
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV, **(env or {})},
    )
    print(f"{script}: {time.monotonic() - started:.1f}s")
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the examples build the tiny model once and share it."""
    return tmp_path_factory.mktemp("example-models")


# -- all of them ---------------------------------------------------------------------------


def scripts() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_run() -> None:
    assert scripts(), f"no examples in {EXAMPLES}"
    missing = sorted(set(scripts()) - set(RUN_BY))
    assert not missing, f"examples without a test in {__file__}: {missing} (use @runs)"
    assert not set(RUN_BY) - set(scripts()), "tests for examples that no longer exist"


def test_every_example_documents_itself_and_has_help() -> None:
    procs = {}
    for script in scripts():
        doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()))
        assert doc and "What it shows" in doc and "Run it" in doc, f"{script}: module docstring"
        assert f"examples/{script}" in doc, f"{script}: the docstring shows how to run it"
        procs[script] = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{script} --help: {err[-2000:]}"
        assert "example:" in out and f"examples/{script}" in out, f"{script} --help: {out}"


# -- one by one ----------------------------------------------------------------------------


@runs("online_training.py")
@pytest.mark.vllm  # skipped without vLLM (tests/conftest.py)
def test_online_training(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "hs"
    proc = example(
        "online_training.py",
        *("--num-prompts", "24", "--batch-size", "6", "--out", str(out)),
        *("--cache-dir", str(cache_dir)),
        timeout=240,
        env=IN_PROCESS_ENGINE,  # the server's model in its engine core: the layout is not the point
    )
    text = proc.stdout
    assert "server ready after" in text
    assert "trained on 24 samples (24 sent, 0 failed)" in text, text
    [(first, last)] = re.findall(r"loss (\d+\.\d+) -> (\d+\.\d+)", text)
    assert float(last) < float(first), text
    assert "reader: 24 samples read, 0 skipped" in text
    assert "server stopped (exit code 0)" in text
    assert f"hidden-state files left in {out}: 0" in text  # deleted once trained on
    assert not list(out.glob("*.safetensors"))


@runs("offline_extract_then_train.py")
@pytest.mark.vllm  # skipped without vLLM (tests/conftest.py)
def test_offline_extract_then_train(tmp_path: Path, cache_dir: Path) -> None:
    work = tmp_path / "run"
    proc = example(
        "offline_extract_then_train.py",
        *("--num-prompts", "24", "--epochs", "2", "--batch-size", "4", "--num-workers", "2"),
        *("--crash-at-step", "3", "--workdir", str(work), "--cache-dir", str(cache_dir)),
        timeout=240,
        env=IN_PROCESS_ENGINE,  # its `hidden-state extract` engine: the layout is not the point
    )
    text = proc.stdout
    assert "done: 24 ok (24 written, 0 already on disk), 0 failed" in text, text
    assert "24 samples, 6 steps per epoch; crashing at step 3" in text
    assert "resumed from ckpt.pt at epoch 0, sample 12 of 24, step 3" in text
    for epoch in (0, 1):
        line = (
            f"epoch {epoch}: 24 samples read across the crash, 24 distinct, planned order kept: OK"
        )
        assert line in text, text
    losses = floats(r"step +\d+ +epoch \d +sample +\d+/24 +loss (\d+\.\d+)", text)
    assert len(losses) == 3 and losses[-1] < losses[0], text  # steps 4, 8, 12
    state = torch.load(work / "ckpt.pt")
    assert state["step"] == 3 and state["loader"]["consumed"] == 12
    assert state["loader"]["epoch"] == 0 and state["loader"]["num_samples"] == 24
    assert len(list((work / "hs").glob("hs_*.safetensors"))) == 24


@runs("ddp_torchrun.py")
def test_ddp_torchrun() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = example(
        "ddp_torchrun.py",
        *("--make-data", "22", "--epochs", "3", "--batch-size", "4", "--num-workers", "1"),
        launcher=torchrun,
        timeout=180,
    )
    text = proc.stdout
    assert "wrote 22 synthetic samples" in text
    assert "22 samples, 2 ranks: 11 per rank and epoch, 3 steps" in text, text
    # even shards: both ranks take the same number of steps; together they cover all data
    assert text.count("steps per rank [3, 3]  samples covered 22/22") == 3, text
    losses = floats(r"epoch \d: loss (\d+\.\d+)", text)
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0], text


@runs("read_vllm_example_connector.py")
@pytest.mark.vllm  # skipped without vLLM (tests/conftest.py)
def test_read_vllm_example_connector(tmp_path: Path) -> None:
    directory = tmp_path / "hs"
    proc = example(
        "read_vllm_example_connector.py", "--make-demo-files", "6", "--dir", str(directory)
    )
    text = proc.stdout
    assert "HiddenStateReader read 6 samples" in text
    assert "identical to vLLM's load_hidden_states: 6/6 files" in text, text
    assert text.count("batch: input_ids") == 2  # 6 samples in batches of 4
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 6
    for path in files:
        # The layout of vLLM's ExampleHiddenStatesConnector: save_file of exactly these
        # two tensors (re-saving them gives the same bytes) and an empty lock file.
        tensors = load_file(path)
        assert set(tensors) == {"hidden_states", "token_ids"}
        assert tensors["token_ids"].dtype == torch.int64 and tensors["hidden_states"].dim() == 3
        again = tmp_path / "again.safetensors"
        save_file(
            {"hidden_states": tensors["hidden_states"], "token_ids": tensors["token_ids"]}, again
        )
        assert again.read_bytes() == path.read_bytes()
        lock = Path(f"{path}.lock")
        assert lock.is_file() and lock.stat().st_size == 0
    if not torch.cuda.is_available():  # vLLM's example connector would crash: say so up front
        cmd = [sys.executable, str(EXAMPLES / "read_vllm_example_connector.py"), "--run-vllm"]
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "--run-vllm needs CUDA" in refused.stderr


@runs("claim_workers.py")
def test_claim_workers(tmp_path: Path) -> None:
    proc = example(
        "claim_workers.py",
        *("--workers", "2", "--groups", "2", "--num-samples", "30", "--dir", str(tmp_path)),
        *("--idle-timeout", "2"),
    )
    text = proc.stdout
    assert "wrote 30 samples" in text
    for group in ("default", "group1"):
        match = re.search(
            rf"group {group}: samples per consumer \[(\d+), (\d+)\], total 30; "
            r"read twice 0, never read 0: each sample exactly once, OK",
            text,
        )
        assert match, text
    claims = tmp_path / ".claims"
    assert sorted(p.name for p in claims.iterdir()) == [".members", "default", "group1"]
    assert len(list((claims / "default").iterdir())) == 30
    # Each consumer was a member of its group while it followed, and left when it stopped.
    assert sorted(p.name for p in (claims / ".members").iterdir()) == ["default", "group1"]
    assert list((claims / ".members" / "default").iterdir()) == []


@runs("store_two_process.py")
def test_store_two_process(tmp_path: Path) -> None:
    """Producer and trainer as two processes with a real Mooncake Store, no shared files."""
    import json

    from store_cluster import MASTER, STORE_UNAVAILABLE, StoreCluster

    if STORE_UNAVAILABLE:
        pytest.skip(STORE_UNAVAILABLE)
    store = StoreCluster(tmp_path / "logs")
    try:
        result = store.net.popen(
            [
                sys.executable,
                str(EXAMPLES / "store_two_process.py"),
                "--master",
                MASTER,
                "--count",
                "12",
            ],
            stdout=subprocess.PIPE,
        ).communicate(timeout=120)[0]
    finally:
        store.close()
    out = json.loads(result.strip().splitlines()[-1])
    assert out["producer_exit"] == 0
    assert out["consumed"] == list(range(12))
    assert out["stats"]["yielded"] == 12 and out["stats"]["skipped"] == 0


@runs("tagged_rollouts.py")
@pytest.mark.vllm  # skipped without vLLM (tests/conftest.py)
def test_tagged_rollouts(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "hs"
    proc = example(
        "tagged_rollouts.py",
        *("--rollouts", "3", "--out", str(out), "--cache-dir", str(cache_dir)),
        timeout=240,
        env=IN_PROCESS_ENGINE,
    )
    text = proc.stdout
    assert "batch of policy step-100: 3 samples, e.g. step-100.rollout-0.safetensors" in text, text
    # The retried requests (same idempotency keys) made no second sample.
    assert "retry of the same batch: 3 of 3 found complete, nothing rewritten" in text, text
    assert "samples per policy version: {'step-100': 3, 'step-200': 3}" in text, text
    assert "dataset sample train-000042.safetensors: row_id=train-000042, 29 tokens" in text
    assert "7 files for 7 distinct keys" in text
    assert len(list(out.glob("*.safetensors"))) == 7


@runs("speculative_rollouts.py")
@pytest.mark.vllm  # skipped without vLLM (tests/conftest.py)
def test_speculative_rollouts(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "hs"
    proc = example(
        "speculative_rollouts.py",
        *("--requests", "4", "--min-rate", "0.8", "--out", str(out), "--cache-dir", str(cache_dir)),
        timeout=240,
        env=IN_PROCESS_ENGINE,
    )
    text = proc.stdout
    counts = [(int(a), int(d)) for a, d in re.findall(r"accepted (\d+) of (\d+) drafts", text)]
    assert len(counts) == 4, text  # every sample carries its counts
    assert all(0 <= a <= d for a, d in counts) and sum(a for a, _ in counts) > 0, text
    kept = sum(a / d >= 0.8 for a, d in counts if d)
    assert f"kept {kept} of 4 samples with acceptance rate >= 0.8" in text, text
    assert len(list(out.glob("*.safetensors"))) == 4
