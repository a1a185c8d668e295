"""Requests preempted while their hidden states are still being copied keep exact values.

A real offline ``LLM`` (vLLM CPU build) in its own process, in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker in the same process), so the script can
read vLLM's preemption counter and count the connector's flushes (``handle_preemptions``).

Sizing (tiny model: 4 layers, 2 KV heads of 64, float32; 3 captured layers of 128): one
block of 32 tokens costs 4 x 32 x 2 x 2 x 64 x 4 B of model KV plus 32 x 3 x 128 x 4 B of
hidden states = 180,224 B (both share one pool of block ids); the KV space is 74 blocks.
The first step prefills the first 64 tokens of a long prompt
(``long_prefill_token_threshold``) and as many 95-token prompts (3 blocks each) as fit.
Their saves are ordered in that step and queue for a single writer thread, one 48 KiB
block per chunk through a single host slab (``chunk_bytes`` 4 KiB and
``host_buffer_bytes`` 8 KiB are below one block). In the next step the long prompt's
next chunk and the first decode tokens need blocks that are not there, so vLLM preempts
the latest-admitted short requests, whose saves are at the tail of that queue, and gives
their blocks to the requests it keeps, which overwrite them from then on. The worker
must finish those copies before the forward pass. (Check made while writing this test:
with ``flush`` turned into a no-op in the script, 3 of 4 runs wrote files whose values
differ from HF's; how many depends on thread timing.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import probe
from hidden_state_reader.format import LockState, lock_path

from conftest import HFReference, assert_matches_reference

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
BLOCK_BYTES = 4 * BLOCK_SIZE * 2 * 2 * 64 * 4 + BLOCK_SIZE * 3 * 128 * 4  # 180,224
KV_BLOCKS = 74  # plus vLLM's null block
PROMPT_LENGTHS = [480] + [95] * 24
MAX_TOKENS = 40
SETUP = {
    "block_size": BLOCK_SIZE,
    "kv_bytes": (KV_BLOCKS + 1) * BLOCK_BYTES,
    "max_num_batched_tokens": 4096,  # room for every short prompt in one step
    "long_prefill_token_threshold": 64,  # the long prompt takes 64 tokens per step
    "prompt_lengths": PROMPT_LENGTHS,
    "max_tokens": MAX_TOKENS,
}

SCRIPT = r"""
import json, os, sys, time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import SharedLock

model, out, setup = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
started = time.monotonic()
llm = LLM(
    model=model,
    dtype="float32",
    max_model_len=1024,
    enforce_eager=True,
    skip_tokenizer_init=True,
    seed=0,
    block_size=setup["block_size"],
    kv_cache_memory_bytes=setup["kv_bytes"],
    max_num_batched_tokens=setup["max_num_batched_tokens"],
    long_prefill_token_threshold=setup["long_prefill_token_threshold"],
    disable_log_stats=False,  # keeps vLLM's preemption counter
    speculative_config=speculative_config([1, 2, 4]),
    kv_transfer_config=kv_transfer_config(
        out,
        {
            "chunk_bytes": 4096,
            "host_buffer_bytes": 8192,
            "num_writer_threads": 1,
            "checksum": True,
            "stats_interval": 0,
        },
    ),
)
startup_s = time.monotonic() - started
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
worker = get_kv_transfer_group()._worker
pipeline = worker.pipeline

# Count the flushes handle_preemptions asks for (the real flush still does the work).
flushes = []
real_flush = pipeline.flush


def counting_flush(req_ids, timeout):
    with pipeline._cond:
        pending = [j for j in pipeline._jobs if j.req_id in req_ids]
        queued = len(pipeline._jobs)
    started = time.monotonic()
    real_flush(req_ids, timeout)
    flushes.append(
        {
            "preempted": len(req_ids),
            "pending": len(pending),
            "queued": queued,
            "seconds": round(time.monotonic() - started, 4),
            "failed": [j.failure for j in pending if j.failure],
        }
    )


pipeline.flush = counting_flush
prompts = [
    {"prompt_token_ids": [(i * 31 + j * 7 + j * j) % 250 for j in range(length)]}
    for i, length in enumerate(setup["prompt_lengths"])
]
sampling = SamplingParams(
    max_tokens=setup["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False
)
started = time.monotonic()
outputs = llm.generate(prompts, sampling, use_tqdm=False)
generate_s = time.monotonic() - started
paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
errors = [o.kv_transfer_params.get("hidden_states_error") for o in outputs]
# No further request: every file must be published by the writer thread on its own.
names = [os.path.basename(p) for p in paths]
published = [str(s.path) for s in HiddenStateReader(out, names=names, lock_timeout=60)]
preemptions = sum(
    m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
)
total = worker.stats.total
report = {
    "free_blocks": free_blocks,
    "startup_s": round(startup_s, 1),
    "generate_s": round(generate_s, 1),
    "paths": paths,
    "prompts": [p["prompt_token_ids"] for p in prompts],
    "outputs": [len(o.outputs[0].token_ids) for o in outputs],
    "errors": errors,
    "published": published,
    # Published small files are read without their locks: wait for each release.
    "held_locks": [p for p in paths if SharedLock.acquire(p, timeout=60) is None],
    "preemptions": preemptions,
    "flushes": flushes,
    "files": total.files,
    "failures": total.failures,
}
print("RESULT " + json.dumps(report), flush=True)
"""


def test_saves_of_preempted_requests_are_exact(
    tiny_model_fp32: Path, hf_fp32: HFReference, tmp_path: Path
) -> None:
    script = tmp_path / "preemption_run.py"
    script.write_text(SCRIPT)
    out = tmp_path / "hs"
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_fp32), str(out), json.dumps(SETUP)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [x[7:] for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    report = json.loads(line)
    flushes = report["flushes"]
    waited = [f for f in flushes if f["pending"]]
    print(
        f"KV blocks: {report['free_blocks']}; preemptions: {report['preemptions']}; "
        f"flushes: {len(flushes)} (preempted requests listed: "
        f"{sum(f['preempted'] for f in flushes)}), of which {len(waited)} found "
        f"{sum(f['pending'] for f in waited)} saves still being copied "
        f"(behind up to {max((f['queued'] for f in waited), default=0)} queued jobs, "
        f"longest wait {max((f['seconds'] for f in flushes), default=0)} s); "
        f"files {report['files']}, failures {report['failures']}; engine start "
        f"{report['startup_s']} s, generate {report['generate_s']} s"
    )
    assert report["free_blocks"] == KV_BLOCKS, "the KV sizing above no longer holds"
    # Preemption really happened, and some preempted saves were still in flight.
    assert report["preemptions"] >= 1
    assert flushes, "handle_preemptions never flushed a preempted request's save"
    assert waited, "no preempted save was still being copied: the test lost its point"
    assert all(f["failed"] == [] for f in flushes), flushes

    # Every answered request has a complete file, its lock released, values exact.
    paths = report["paths"]
    assert len(set(paths)) == len(PROMPT_LENGTHS)
    assert report["errors"] == [None] * len(PROMPT_LENGTHS)
    assert report["outputs"] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert sorted(report["published"]) == sorted(paths)
    assert report["held_locks"] == []
    assert report["files"] == len(PROMPT_LENGTHS) and report["failures"] == 0
    names = [os.path.basename(p) for p in paths]
    samples = {str(s.path): s for s in HiddenStateReader(out, names=names, on_error="raise")}
    for path, prompt in zip(paths, report["prompts"], strict=True):
        sample = samples[path]
        assert sample.token_ids.tolist() == prompt
        assert sample.layer_ids == [1, 2, 4]
        assert_matches_reference(sample, hf_fp32)
    assert all(probe(lock_path(p)) is LockState.FREE for p in paths)
    assert not [f for f in os.listdir(out) if ".tmp." in f]
