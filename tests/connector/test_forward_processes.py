"""Forward capture where vLLM runs its model in processes of its own: compiled, and TP=2.

Both engines run as users run ``vllm serve``: the worker (two of them with TP=2) in a
process of its own, which loads the connector's plugin itself (vLLM's general plugins).

- **Compiled** (torch.compile on the CPU build; CUDA graphs on a GPU): vLLM compiles the
  model during its memory profile, before the connector exists. The capture must already
  be in the model then (the plugin hooks it while vLLM builds it) and survive compilation
  as one operator (``engine/forward/capture_op.py``).
- **TP=2**: the residual stream is whole on every rank; rank 0 captures and writes.

Every stored row is compared with Hugging Face's float32 residual stream.
"""

from __future__ import annotations

import json
import os
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

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS // 2, NUM_LAYERS]

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts, transfer, settings = sys.argv[1], *map(json.loads, sys.argv[2:5])
    llm = LLM(model=model, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 * 1024**2,
              skip_tokenizer_init=True, seed=0, kv_transfer_config=transfer, **settings)
    params = SamplingParams(max_tokens=int(sys.argv[5]), temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    rows = [[list(o.prompt_token_ids), list(o.outputs[0].token_ids),
             o.kv_transfer_params["hidden_states_path"]] for o in outs]
    print("RESULT " + json.dumps(rows))
"""

CASES = {
    # name: (engine settings, environment, what the log must show)
    # (vLLM 0.32 CPU traces with Dynamo and saves the result: "saved AOT compiled function")
    "compiled": ({}, {"VLLM_LOGGING_LEVEL": "INFO"}, "AOT compiled function"),
    # The CPU build binds each rank to a core of its own (two ranks need a binding).
    "tp2": (
        {"tensor_parallel_size": 2, "enforce_eager": True},
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "Worker_TP1",
    ),
}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 1, 17, 90)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_in_its_own_processes_captures_the_hf_rows(case: str, tmp_path: Path) -> None:
    settings, env, shown = CASES[case]
    model = build_tiny_model(tmp_path / "model", dtype="float32", num_layers=NUM_LAYERS)
    extra: dict[str, Any] = forward_extra(LAYERS, include_output_tokens=True)
    transfer = kv_transfer_config(str(tmp_path / "hs"), extra)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    args = [json.dumps(_prompts()), json.dumps(transfer), json.dumps(settings), str(MAX_TOKENS)]
    done = subprocess.run(
        [sys.executable, str(script), str(model), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-4000:]
    assert shown in logs  # compiled; two ranks
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    reference = Reference(model, NUM_LAYERS)
    worst = 0.0
    for prompt, generated, path in json.loads(line[len("RESULT ") :]):
        sample = read_one(path)
        assert sample.token_ids.tolist() == prompt + generated[:-1]
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= RTOL, f"{case}: relative errors {errors}"
        worst = max(worst, *errors.values())
    print(f"{case}: worst relative error {worst:.1e}")
