"""PP=2 forward capture into the store: ``python -m tools.store_vllm_pp MODEL MASTER PREFIX``.

Runs inside the store test's namespace: vLLM's CPU build with ``pipeline_parallel_size=2``
(one worker process per stage, each bound to a core), ``capture: "forward"`` and
``storage_backend="mooncake"``; the last stage's rank 0 puts each sample in the store.
Prompts of 1-150 tokens with chunked prefill at 64, their generated tokens included;
every sample is read back from the store by its key and each captured layer compared
with HF float32 (``hf_reference``). Prints one JSON line: per request, its prompt, its
generated tokens, the stored token ids and layer ids, and each layer's relative error.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

from forward_kit import MAX_TOKENS, forward_extra, prompts
from hf_reference import Reference

from hidden_state_connector.apps.server import kv_transfer_config
from hidden_state_reader import HiddenStateReader

from procs import IN_PROCESS_ENGINE

# Stage 0 computes ids 0, 1, 2; the writing last stage none of these (it still writes
# every sample: the case tests/connector/test_pipeline_parallel.py leaves to this one).
LAYERS = [1, 2]


def main() -> None:
    model, master, prefix = sys.argv[1:4]
    os.environ.update(IN_PROCESS_ENGINE)
    os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    from vllm import LLM, SamplingParams

    store = {
        "storage_backend": "mooncake", "mooncake_master": master, "mooncake_prefix": prefix,
        "mooncake_local_hostname": "127.0.0.1", "mooncake_buffer_bytes": "64MiB",
        "num_writer_threads": 2,
    }  # fmt: skip
    llm = LLM(
        model=model, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
        enable_prefix_caching=False, skip_tokenizer_init=True, seed=0,
        pipeline_parallel_size=2, distributed_executor_backend="mp",
        kv_transfer_config=kv_transfer_config(
            None, forward_extra(LAYERS, include_output_tokens=True, **store)
        ),
    )  # fmt: skip
    batch = prompts()
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], sampling)
    keys = [o.kv_transfer_params["hidden_states_key"] for o in outputs]
    url = f"mooncake://{master}/{prefix}?hostname=127.0.0.1"
    reader = HiddenStateReader(url, names=keys, lock_timeout=60, on_error="raise")
    by_key = {s.path.rsplit("/", 1)[-1]: s for s in reader}
    del llm
    gc.collect()
    reference = Reference(Path(model), 4)
    rows = []
    for out, key in zip(outputs, keys, strict=True):
        sample = by_key[key]
        rows.append({
            "prompt": list(out.prompt_token_ids), "generated": list(out.outputs[0].token_ids),
            "tokens": sample.token_ids.tolist(), "layer_ids": sample.layer_ids,
            "errors": reference.layer_errors(sample),
        })  # fmt: skip
    print(json.dumps({"requests": rows}), flush=True)


if __name__ == "__main__":
    main()
