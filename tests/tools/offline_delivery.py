"""An offline ``LLM`` script as users write it: ``python offline_delivery.py MODEL OUT``.

Runs in the engine mode of ``VLLM_ENABLE_V1_MULTIPROCESSING`` (0: in-process), with the
executor named by ``EXECUTOR`` (``uni``: the worker in the engine's process, ``mp``: in
a process of its own, as with tensor parallelism; default: vLLM's choice). Sends
one batch of prompt-only requests and one with generated tokens
(``include_output_tokens``), and after each batch waits (sleeping on the locks, no new
requests) until every answered request's file is published, printing one line per
batch: ``RESULT {"batch", "paths", "published", "missing", "waited_s"}``. Then it sends a
last batch and exits right after ``generate()`` returns, printing its paths: the
caller checks that those files exist once the process has ended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_reader import HiddenStateReader

WAIT_S = 20.0  # generous: a loaded CI machine; the printed figure is what matters


def prompts(count: int, first: int) -> list[dict[str, list[int]]]:
    """``count`` distinct token-id prompts of 20, 21, ... tokens."""
    return [
        {"prompt_token_ids": [(first + i * 7 + j) % 200 for j in range(20 + i)]}
        for i in range(count)
    ]


def wait_published(out: Path, paths: list[str]) -> dict[str, object]:
    """Read the batch's samples as they complete; no further request is sent."""
    returned = time.monotonic()
    names = [os.path.basename(p) for p in paths]
    reader = HiddenStateReader(out, names=names, lock_timeout=WAIT_S, on_error="skip")
    published = [str(s.path) for s in reader]
    return {
        "published": len(published),
        "missing": sorted(set(paths) - set(published)),
        "waited_s": round(time.monotonic() - returned, 3),
    }


def _free_blocks(llm: object) -> int | None:
    """Free KV blocks of an in-process engine (None when the engine is in another process)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    if scheduler is None:
        return None
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def main() -> None:
    from vllm import LLM, SamplingParams

    model, out = sys.argv[1], Path(sys.argv[2])
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=128 * 1024**2,
        skip_tokenizer_init=True,
        seed=0,
        distributed_executor_backend=os.environ.get("EXECUTOR") or None,
        speculative_config=speculative_config([1, 3]),
        kv_transfer_config=kv_transfer_config(str(out), {"stats_interval": 0}),
    )
    batches = [
        ("prompt", SamplingParams(max_tokens=1, detokenize=False), 4),
        (
            "output",
            SamplingParams(
                max_tokens=5,
                detokenize=False,
                extra_args={"kv_transfer_params": {"include_output_tokens": True}},
            ),
            3,
        ),
    ]
    free_at_start = _free_blocks(llm)
    for index, (name, sampling, count) in enumerate(batches):
        outputs = llm.generate(prompts(count, 10 * index), sampling, use_tqdm=False)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
        report = {"batch": name, "paths": paths, **wait_published(out, paths)}
        print("RESULT", json.dumps(report), flush=True)
    if free_at_start is not None:
        # Reports of copied samples reach the scheduler in later steps: two more
        # one-prompt batches, after which only the last prompt's blocks may be held.
        for first in (150, 160):
            llm.generate(prompts(1, first), batches[0][1], use_tqdm=False)
        held = free_at_start - (_free_blocks(llm) or 0)
        print("RESULT", json.dumps({"batch": "blocks", "held": held, "paths": []}), flush=True)
    # The script ends right after its last generate(): nothing may be lost.
    plain, with_output = batches[0][1], batches[1][1]
    outputs = llm.generate(prompts(4, 50), [plain, plain, with_output, with_output], use_tqdm=False)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    print("RESULT", json.dumps({"batch": "at-exit", "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
