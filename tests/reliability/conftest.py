"""Fixtures of the reliability suite: figures, the --long switch, a tiny model, servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hidden_state_connector.apps.server import ServeOptions, VllmServer

from tools.relkit import Figures

# Keep vLLM quiet and local (as tests/connector/conftest.py does).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def long_run(pytestconfig: pytest.Config) -> bool:
    """Whether the suite runs with ``--long``."""
    return bool(pytestconfig.getoption("--long"))


@pytest.fixture
def figures(request: pytest.FixtureRequest, long_run: bool) -> Figures:
    """Print figures and append them to ``tests/reliability/.results/<module>.jsonl``."""
    module = Path(str(request.node.fspath)).stem
    return Figures(module, request.node.name, long_run)


@pytest.fixture
def start_server() -> Iterator[Any]:
    """Start ``VllmServer``s that are always stopped (or already killed) at teardown."""
    started: list[VllmServer] = []

    def start(options: ServeOptions, log_file: Path) -> VllmServer:
        server = VllmServer(options, log_file=log_file)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
