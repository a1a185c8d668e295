"""Tensor parallelism on vLLM's CPU build: one writer, exact values, no leaked blocks.

``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each of the two ranks one core (the CPU build
refuses to start two ranks without a binding). The run is a real script
(``tests/tools/tensor_parallel_run.py``) in a process of its own; the workers' log
lines tell which pid is which rank. Pipeline parallelism is refused by vLLM itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader

from conftest import HFReference, assert_matches_reference

pytestmark = [pytest.mark.vllm, pytest.mark.long]

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "tensor_parallel_run.py"
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_LOGGING_LEVEL": "INFO"}
CONNECTOR_LINE = re.compile(r"\(Worker_TP(\d) pid=(\d+)\).*HiddenStateConnector: cpu.*")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV},
    )


def test_tp2_rank0_writes_exact_values_frees_blocks_and_drains(
    tiny_model_fp32: Path, hf_fp32: HFReference, tmp_path: Path
) -> None:
    out = tmp_path / "hs"
    done = _run(str(SCRIPT), str(tiny_model_fp32), str(out), "2", timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [x[7:] for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    report = json.loads(line)
    logs = done.stdout + done.stderr  # vLLM logs to stdout unless told otherwise
    ranks = {m.group(1): (int(m.group(2)), m.group(0)) for m in CONNECTOR_LINE.finditer(logs)}
    assert sorted(ranks) == ["0", "1"], logs[-4000:]
    assert "(not this TP rank)" in ranks["1"][1] and "(not this TP rank)" not in ranks["0"][1]
    # Only rank 0 wrote: every lock file names its pid.
    assert report["writer_pids"] == [ranks["0"][0]]
    # No blocks held once the files are published, batch after batch.
    assert report["free_after"] == [report["free_before"]] * 3
    # Shutting down right after the last batch drained its writes.
    paths = report["paths"]
    assert len(set(paths)) == 16 and report["held"] == [] and report["published"] == paths
    assert [f for f in os.listdir(out) if ".tmp." in f] == []
    # Values: what TP=1 gives (both equal HF's float32 values; TP=1: test_offline.py).
    for sample in HiddenStateReader(out, names=[os.path.basename(p) for p in paths]):
        assert_matches_reference(sample, hf_fp32)


def test_pipeline_parallel_is_refused_by_vllm_at_once(
    tiny_model_fp32: Path, tmp_path: Path
) -> None:
    script = tmp_path / "pp.py"
    script.write_text(
        SCRIPT.read_text().replace("tensor_parallel_size=tp", "pipeline_parallel_size=tp")
    )
    # Refused within a minute, or the run times out and the test fails.
    done = _run(str(script), str(tiny_model_fp32), str(tmp_path / "hs"), "2", timeout=60)
    assert done.returncode != 0
    assert "Pipeline parallelism is not supported for this model" in done.stdout + done.stderr
    assert not (tmp_path / "hs").exists()
