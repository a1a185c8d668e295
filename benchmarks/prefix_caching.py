"""Forward capture under prefix caching: hit rate and held host bytes (vLLM CPU build).

Two loads on one in-process engine (a tiny Llama; hit rates do not depend on the model's
size, host bytes scale with ``layers x hidden``: the report gives both the measured bytes
and the bytes per held token):

* GRPO-like: groups of 8 samples of one prompt (a shared 1,024-token system prompt and a
  64-token question), each storing its 64 generated tokens;
* multi-turn chats: 8 conversations of 4 turns, each turn's prompt the last prompt, its
  reply and a new 32-token message.

Per load: prompt tokens, tokens vLLM served from its prefix cache (the hit rate), held
prefix blocks and their host bytes at the end, requests that had to recompute a prefix
whose rows were not held, and every sample checked complete (one row per token).

Usage: python -m benchmarks.prefix_caching [--groups 8] [--json out.json]
Example: python -m benchmarks.prefix_caching --groups 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEM_TOKENS, QUESTION_TOKENS, SAMPLES, GENERATED = 1024, 64, 8, 64
CHATS, TURNS, MESSAGE_TOKENS, REPLY_TOKENS = 8, 4, 32, 48
LAYERS = [1, 2, 4]


def _engine(model: Path, out: str) -> Any:
    from vllm import LLM

    from hidden_state_connector.apps.server import kv_transfer_config

    extra = {"capture": "forward", "layer_ids": LAYERS, "stats_interval": 0}
    return LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=4096,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=256 * 1024**2,
        skip_tokenizer_init=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_transfer_config(out, extra),
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        ignore_eos=True,
        detokenize=False,
        extra_args={"kv_transfer_params": {"include_output_tokens": True}},
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(gen: Any, n: int) -> list[int]:
    import torch

    return torch.randint(3, 250, (n,), generator=gen).tolist()


def _connector_state(llm: Any) -> tuple[Any, Any]:
    """The scheduler half's planner and the worker's row source (in-process engine)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    planner = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.rows
    return planner, get_kv_transfer_group()._worker.rows


def _recomputed(llm: Any) -> int:
    return int(_connector_state(llm)[0].counters.recomputed)


def _summary(
    name: str, outputs: list[Any], llm: Any, started: float, recomputed: int
) -> dict[str, Any]:
    from hidden_state_reader import HiddenStateReader

    planner, rows = _connector_state(llm)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    by_path = {o.kv_transfer_params["hidden_states_path"]: o for o in outputs}
    names = [os.path.basename(p) for p in by_path]
    reader = HiddenStateReader(os.path.dirname(next(iter(by_path))), names=names, on_error="raise")
    complete = 0
    for sample in reader:  # one row per token: the prompt and the fed-back generated tokens
        output = by_path[str(sample.path)]
        expected = len(output.prompt_token_ids) + len(output.outputs[0].token_ids) - 1
        complete += int(sample.num_tokens == expected == sample.hidden_states.shape[0])
    token_bytes = rows.arena.data[0, 0].numel() * rows.arena.data.element_size()
    held_tokens = rows.held.held_blocks * planner.prefix.block_tokens
    return {
        "load": name,
        "requests": len(outputs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 3),
        "recomputed_requests": planner.counters.recomputed - recomputed,
        "held_prefix_tokens": held_tokens,
        "held_host_bytes": held_tokens * token_bytes,
        "bytes_per_token": token_bytes,
        "held_bytes_per_token_8b_shape": 4 * 4096 * 2,
        "samples_complete": complete,
        "seconds": round(time.monotonic() - started, 1),
    }


def grpo(llm: Any, groups: int) -> dict[str, Any]:
    """Groups of ``SAMPLES`` samples of one prompt sharing one system prompt."""
    import torch

    gen = torch.Generator().manual_seed(0)
    system = _tokens(gen, SYSTEM_TOKENS)
    prompts = [system + _tokens(gen, QUESTION_TOKENS) for _ in range(groups)]
    started, recomputed = time.monotonic(), _recomputed(llm)
    outputs = _generate(llm, [p for p in prompts for _ in range(SAMPLES)], GENERATED)
    return _summary("grpo", outputs, llm, started, recomputed)


def multi_turn(llm: Any) -> dict[str, Any]:
    """``CHATS`` conversations of ``TURNS`` turns, each turn's prompt the whole chat so far."""
    import torch

    gen = torch.Generator().manual_seed(1)
    chats = [_tokens(gen, 200) for _ in range(CHATS)]
    outputs: list[Any] = []
    started, recomputed = time.monotonic(), _recomputed(llm)
    for _ in range(TURNS):
        turn = _generate(llm, chats, REPLY_TOKENS)
        outputs += turn
        chats = [
            list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + _tokens(gen, MESSAGE_TOKENS)
            for o in turn
        ]
    return _summary("multi-turn", outputs, llm, started, recomputed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=8, help="GRPO prompts (8 samples each)")
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the counters, in-process
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hs-prefix-"))
    model = build_tiny_model(work / "model", dtype="bfloat16", num_layers=4)
    llm = _engine(model, str(work / "out"))
    try:
        rows = [grpo(llm, args.groups), multi_turn(llm)]
    finally:
        del llm
        gc.collect()
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
