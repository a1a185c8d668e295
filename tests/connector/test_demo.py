"""``hidden-state demo``: a real ``vllm serve`` streaming into the draft-head training loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from procs import DEMO, IN_PROCESS_ENGINE

SERVER_ENV = {**os.environ, **IN_PROCESS_ENGINE}
"""The demo's server keeps its model in the engine core (procs.IN_PROCESS_ENGINE): the
demo runs end to end here, the process layout is tested elsewhere."""


# -- the real thing --------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_demo_streams_every_prompt_into_training_exactly_once(
    tmp_path: Path, demo_cache_dir: Path
) -> None:
    out = tmp_path / "demo"
    started = time.monotonic()
    proc = subprocess.run(
        [*DEMO, "--num-prompts", "40", "--out", str(out), "--cache-dir", str(demo_cache_dir)],
        capture_output=True,
        text=True,
        timeout=450,  # a bound on a hang, not on speed (a loaded machine is slow)
        env=SERVER_ENV,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    assert summary["prompts"] == summary["produced"] == summary["consumed"] == 40
    assert summary["unique_consumed"] == 40 and summary["failed_requests"] == 0
    assert summary["tokens_produced"] == summary["tokens_consumed"] > 40
    assert summary["bytes_read"] > 0
    assert summary["files_left"] == 0
    assert not [f for _, _, files in os.walk(out / "hs") for f in files]
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["server_exit_code"] == 0
    png = out / "loss.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "samples consumed" in proc.stdout and "OK" in proc.stdout  # the table
    assert "produced" in proc.stderr and "MB/s" in proc.stderr  # live progress
    print(f"demo took {elapsed:.0f}s")


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_server_cleanly_and_exits_130(
    tmp_path: Path, demo_cache_dir: Path
) -> None:
    out = tmp_path / "demo"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = subprocess.Popen(
            [*DEMO, "--num-prompts", "5000", "--out", str(out), "--cache-dir", str(demo_cache_dir)],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            env=SERVER_ENV,
        )
        try:
            deadline = time.monotonic() + 240
            while "produced" not in err.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, err.read_text()
                time.sleep(0.2)
            children = psutil.Process(proc.pid).children(recursive=True)
            assert children, "the server runs as a child process"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130, err.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "stopping cleanly" in err.read_text()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, "server processes survived"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and not summary["ok"]
    assert summary["server_exit_code"] == 0
    assert 0 < summary["consumed"] < 5000
