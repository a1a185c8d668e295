"""Forward capture under pipeline parallelism (PP=2) on vLLM's CPU build, against HF float32.

Each stage holds half of a tiny Qwen3's layers and captures the ids it computes; the last
stage's rank writes one sample per request with every requested layer, in order
(``engine/forward/stages.py``). The engine runs as users run it: a script in a process of
its own (the engine core in it), vLLM's ``mp`` executor with one worker process per
stage, each bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; the CPU
build refuses two ranks without a binding). Prompts of 1-150 tokens with chunked prefill
at 64, with and without their generated tokens; every stored row is compared with Hugging
Face's float32 stream, while a stage fails the first step: that step's sample fails,
loudly, the others are right. (The store medium's test captures first-stage ids only.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_kit import MAX_TOKENS, RTOL, forward_extra
from hf_reference import Reference, read_one

from hidden_state_connector.apps.server import kv_transfer_config
from hidden_state_connector.apps.tiny_model import build_tiny_model

from procs import IN_PROCESS_ENGINE

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4  # stage 0: layers 0-1 (ids 0, 1, 2); stage 1: layers 2-3 (ids 3, 4)
ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts, transfer = sys.argv[1], *map(json.loads, sys.argv[2:4])
    llm = LLM(model=model, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
              enable_prefix_caching=False, skip_tokenizer_init=True,
              seed=0, kv_transfer_config=transfer, pipeline_parallel_size=2,
              distributed_executor_backend="mp")
    rows = []
    for include in (True, False):
        params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params":
                                            {"include_output_tokens": include}})
        batch = prompts if include else prompts[::2]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        rows += [[include, list(o.prompt_token_ids), list(o.outputs[0].token_ids),
                  o.kv_transfer_params["hidden_states_path"]] for o in outs]
    print("RESULT " + json.dumps(rows))
"""


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 1, 17, 90)]


def _run(
    model: Path, out: Path, extra: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[str, str]:
    script = tmp_path / "run_pp.py"
    script.write_text(SCRIPT)
    transfer = kv_transfer_config(str(out), extra)
    args = [json.dumps(_prompts()), json.dumps(transfer), str(MAX_TOKENS)]
    # A session of its own: on a timeout the engine's worker processes go with the script.
    with subprocess.Popen(
        [sys.executable, str(script), str(model), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **IN_PROCESS_ENGINE, **ENV, **(env or {})},
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    logs = stdout + stderr
    assert proc.returncode == 0, logs[-6000:]
    return stdout, logs


# Fault injection, in every process of the engine (``sitecustomize``): the first step's
# rows of the first stage are replaced by the failure a stage sends when it cannot copy
# them. Installed when the stages module is first imported, so nothing else changes.
FAULT = """
import importlib.abc, importlib.util, sys

TARGET = "hidden_state_connector.engine.forward.stages"


def _patch(module):
    send, sent = module.StageLink.send, []

    def first_fails(self, slots, rows, failure=""):
        sent.append(1)
        if len(sent) == 1:
            return send(self, None, None, failure="injected")
        return send(self, slots, rows, failure)

    module.StageLink.send = first_fails


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
"""


def test_a_stage_that_fails_fails_its_samples_loudly(tmp_path: Path) -> None:
    from hidden_state_reader.files.locks import read_status
    from hidden_state_reader.format import lock_path

    model = build_tiny_model(
        tmp_path / "model", dtype="float32", num_layers=NUM_LAYERS, arch="qwen3"
    )
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAULT)
    path = os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "hs"
    extra = forward_extra([0, 1, 2, 4], include_output_tokens=True)
    stdout, logs = _run(model, out, extra, tmp_path, {"PYTHONPATH": path})
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    reference = Reference(model, NUM_LAYERS)
    failed = []
    for include, prompt, generated, sample_path in results:
        status = read_status(lock_path(sample_path))
        if status.failed:  # no sample under its name, the reason in its lock
            assert not os.path.exists(sample_path)
            failed.append(status.reason)
            continue
        sample = read_one(sample_path)
        assert len(generated) == MAX_TOKENS
        # The last generated token is never fed back: it has no hidden state.
        assert sample.token_ids.tolist() == (prompt + generated[:-1] if include else prompt)
        assert sample.layer_ids == [0, 1, 2, 4]
        assert max(reference.layer_errors(sample).values()) <= RTOL
    # The first step computed only the first request's first chunk: its sample failed,
    # with the stage named, in its lock and in the log; every other one (ids of both
    # stages, the 150-token prompt-only one with chunked prefill too) equals HF.
    assert failed == ["pipeline stage 0 could not copy this step's rows"], failed
    assert len(results) == 6
    assert "pipeline stage 0 could not copy this step's rows" in logs
    assert "pipeline stage 1 of 2" in logs and "pipeline stage 0 of 2" in logs
    # One sample per request, published once: no part, temp file or extra name is left.
    # (Captured ids on the first stage only: tests/mooncake/test_vllm_store.py.)
    names = sorted(os.listdir(out))
    assert [n for n in names if not n.endswith((".safetensors", ".safetensors.lock"))] == []
    assert len([n for n in names if n.endswith(".safetensors")]) == len(results) - 1
