"""An offline ``LLM`` with tensor parallelism: ``python tensor_parallel_run.py MODEL OUT TP``.

The engine core runs in this process (so the script can read the scheduler's free KV
blocks); the ``TP`` workers run in processes of their own (vLLM's ``mp`` executor).
Sends four batches of prompts of 5 to 125 tokens with generated tokens included and, after
each of the first three, waits until every file is published and vLLM has freed the
requests' blocks. Right after the fourth batch it shuts the engine down, which must
drain the writes still in flight. Prints ``RESULT {...}``: the free blocks before and
after each batch, the paths, the locks still held, the files published, the pids that
wrote them (from the lock files) and this process's pid.
"""

from __future__ import annotations

import gc
import json
import os
import sys

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import probe, read_status
from hidden_state_reader.format import LockState, lock_path

BATCHES = 4
STEPS_TO_FREE = 50  # engine steps to wait for vLLM to free reported blocks


def _prompts(batch: int) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(batch * 37 + i * 11 + j * j) % 250 for j in range(5 + 40 * i)]}
        for i in range(4)
    ]


def main(model: str, out: str, tp: int) -> None:
    """Run the batches and print the report."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=64 * 1024**2,
        max_num_batched_tokens=64,  # chunked prefill
        enable_prefix_caching=True,
        speculative_config=speculative_config([1, 2, 4]),
        kv_transfer_config=kv_transfer_config(
            out, {"include_output_tokens": True, "stats_interval": 0}
        ),
    )
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=False)
    paths: list[str] = []
    free_after: list[int] = []
    for batch in range(BATCHES):
        outputs = llm.generate(_prompts(batch), sampling, use_tqdm=False)
        paths += [o.kv_transfer_params["hidden_states_path"] for o in outputs]
        if batch == BATCHES - 1:
            break
        names = [os.path.basename(p) for p in paths]
        assert len(list(HiddenStateReader(out, names=names, lock_timeout=60))) == len(names)
        for _ in range(STEPS_TO_FREE):  # blocks are freed in the step after the report
            if pool.get_num_free_blocks() == free_before:
                break
            llm.llm_engine.step()
        free_after.append(pool.get_num_free_blocks())
    llm.llm_engine.engine_core.shutdown()  # the last batch's writes may be in flight
    del llm
    gc.collect()
    report = {
        "free_before": free_before,
        "free_after": free_after,
        "paths": paths,
        "held": [p for p in paths if probe(lock_path(p)) is not LockState.FREE],
        "published": [p for p in paths if os.path.exists(p)],
        "writer_pids": sorted({read_status(lock_path(p)).detail.get("pid") for p in paths}),
        "main_pid": os.getpid(),
    }
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":  # vLLM's workers start by spawning: guard the main module
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
