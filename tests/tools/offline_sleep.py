"""``llm.sleep()`` right after ``generate()``: ``python offline_sleep.py MODEL OUT``.

The CPU build refuses ``enable_sleep_mode`` (its platform has no sleep mode) and its
worker ignores ``sleep`` / ``wake_up``, but the engine core still runs vLLM's pause
before sleeping: abort what runs, then reset the prefix cache, which needs every KV
block free, including the blocks the connector holds for samples whose copies are in
flight. Small host buffers keep copies in flight when ``generate()`` returns. Two rounds
of a batch, ``sleep(level=1)``, ``wake_up()``; prints ``RESULT {"slept": [...],
"failed": [...], "paths": [...]}`` (``failed``: the exception vLLM raised, per round).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config


def main() -> None:
    from vllm import LLM, SamplingParams

    model, out = sys.argv[1], Path(sys.argv[2])
    settings = {"stats_interval": 0, "host_buffer_bytes": 65536, "chunk_bytes": 8192}
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=128 * 1024**2,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=speculative_config([1, 3]),
        kv_transfer_config=kv_transfer_config(str(out), settings),
    )
    sampling = SamplingParams(max_tokens=1, detokenize=False)
    slept, failed, paths = [], [], []
    for round_no in range(2):
        prompts = [
            {"prompt_token_ids": [(round_no * 31 + i * 7 + j) % 200 + 1 for j in range(100 + i)]}
            for i in range(6)
        ]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        paths += [o.kv_transfer_params["hidden_states_path"] for o in outputs]
        try:
            llm.sleep(level=1)
            slept.append(round_no)
        except RuntimeError as exc:
            failed.append(str(exc))
        llm.wake_up()
    print("RESULT", json.dumps({"slept": slept, "failed": failed, "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
