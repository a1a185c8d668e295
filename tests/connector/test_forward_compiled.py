"""Forward capture in a compiled model (torch.compile on the CPU build; CUDA graphs on a GPU).

vLLM compiles the model during its memory profile, before the connector exists: the
capture must already be in the model then (the plugin hooks it while vLLM builds it) and
must survive compilation as one operator (``engine/forward/capture_op.py``). The engine
runs as users run ``vllm serve``: its worker in a process of its own, which loads the
plugin itself. Every stored row is compared with Hugging Face's float32 residual stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import Reference, read_one

from hidden_state_connector.apps.server import kv_transfer_config
from hidden_state_connector.apps.tiny_model import build_tiny_model

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
LAYERS = [0, 1, NUM_LAYERS // 2, NUM_LAYERS]
RTOL = 1e-5
MAX_TOKENS = 5

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

model, prompts = sys.argv[1], json.loads(sys.argv[2])
if __name__ == "__main__":
    llm = LLM(model=model, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 * 1024**2,
              skip_tokenizer_init=True, seed=0, kv_transfer_config=json.loads(sys.argv[3]))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    rows = [[list(o.prompt_token_ids), list(o.outputs[0].token_ids),
             o.kv_transfer_params["hidden_states_path"]] for o in outs]
    print("RESULT " + json.dumps(rows))
""".replace("MAX_TOKENS", str(MAX_TOKENS))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 1, 17, 90)]


def test_compiled_model_captures_the_same_rows(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    model = build_tiny_model(tmp_path / "model", dtype="float32", num_layers=NUM_LAYERS)
    extra: dict[str, Any] = {
        "capture": "forward",
        "layer_ids": LAYERS,
        "stats_interval": 0,
        "include_output_tokens": True,
    }
    transfer = kv_transfer_config(str(tmp_path / "hs"), extra)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(model), json.dumps(_prompts()), json.dumps(transfer)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Dynamo bytecode transform time" in done.stderr  # the model was compiled
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    reference = Reference(model, NUM_LAYERS)
    worst = 0.0
    for prompt, generated, path in json.loads(line[len("RESULT ") :]):
        sample = read_one(path)
        assert sample.token_ids.tolist() == prompt + generated[:-1]
        errors = reference.layer_errors(sample)
        assert max(errors.values()) <= RTOL, f"relative errors {errors}"
        worst = max(worst, *errors.values())
    print(f"compiled: worst relative error {worst:.1e}")
