"""vLLM CPU -> connector (storage_backend="mooncake") -> store -> HiddenStateReader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from store_cluster import MASTER, StoreCluster, finish, needs_store

pytestmark = [needs_store, pytest.mark.vllm]  # skipped without vLLM (tests/conftest.py)


def test_round_trip_through_the_connector(
    cluster: StoreCluster, tmp_path: Path, tiny_model_fp32: Path
) -> None:
    model = tiny_model_fp32
    # The engine runs in the store's namespace; it hosts no store memory.
    proc = cluster.net.popen([sys.executable, "-m", "tools.store_vllm", str(model), MASTER, "vllm"],
                             stdout=subprocess.PIPE)  # fmt: skip
    result = finish(proc, timeout=600)
    for params, prompt, tokens, layer_ids, errors in zip(
        result["params"], result["prompts"], result["tokens"], result["layer_ids"],
        result["errors"], strict=True,
    ):  # fmt: skip
        assert params["hidden_states_url"].endswith("/vllm/" + params["hidden_states_key"])
        assert "hidden_states_path" not in params, "no local file is written: none is named"
        assert tokens == prompt
        assert layer_ids == [1, 2, 4]
        assert errors and max(errors) < 1e-4, errors
    # A keyed request, consumed by a deleting reader, then retried: within its key's
    # retention the store is asked, nothing is written, and the response says it existed.
    retries = result["retries"]
    key = retries["first"]["hidden_states_key"]
    assert key == "row-1.safetensors" and "hidden_states_existed" not in retries["first"]
    assert retries["taken"] == [result["prompts"][0]]
    assert retries["retry"]["hidden_states_existed"] is True
    assert retries["retry"]["hidden_states_key"] == key
    assert retries["stored_after_retry"] is False, "nothing was written for the retry"
    # Forgotten (clean): the next retry is written again, and read again.
    assert retries["forgotten"] == ["vllm/consumed/" + key]
    assert "hidden_states_existed" not in retries["after_clean"]
    assert retries["taken_again"] == [result["prompts"][0]]


def test_pipeline_parallel_forward_capture_into_the_store(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    """PP=2 forward capture: the last stage's rank 0 puts one sample per request, though
    it computes none of the captured layers (every row comes from the first stage)."""
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", dtype="float32", num_layers=4, arch="qwen3")
    argv = [sys.executable, "-m", "tools.store_vllm_pp", str(model), MASTER, "pp"]
    proc = cluster.net.popen(argv, stdout=subprocess.PIPE)
    result = finish(proc, timeout=600)
    requests = result["requests"]
    assert len(requests) == 4
    worst = 0.0
    for row in requests:
        # The last generated token is never fed back: it has no hidden state.
        assert row["tokens"] == row["prompt"] + row["generated"][:-1]
        assert row["layer_ids"] == [1, 2]
        errors = row["errors"].values()
        assert max(errors) <= 1e-5, row["errors"]
        worst = max(worst, *errors)
    print(f"PP=2 into the store: worst relative error {worst:.1e}")
