"""Sleep mode on a GPU: every answered sample survives ``llm.sleep()`` / ``llm.wake_up()``.

    python benchmarks/gpu/sleep_check.py --jsonl /tmp/out/results.jsonl
    python benchmarks/gpu/sleep_check.py --rounds 3 --level 1 --prompts 32

One engine (the tiny random Llama in bf16, built locally; ``enable_sleep_mode=True``; the
default multiprocess engine, as RL frameworks run it) with the connector, small host
buffers so copies are still in flight when a batch returns. Per round: one batch of
prompts of mixed lengths (half prompt-only, half with 8 generated tokens stored, each
tagged with its round), then ``llm.sleep(level)`` right after ``generate()`` returns, then
``llm.wake_up()``; the next round's batch runs on the woken engine. At the end every
answered sample is read back (CRC checked) and compared with HF transformers' hidden
states for the same tokens, layer by layer (``bench._compare_with_hf``): a sample copied
from a released cache would hold zeros or garbage and fail.

One JSON line (``kind: "sleep"``) goes to stdout after ``RESULT `` and is appended to
``--jsonl``: answered, read back, failed and mismatching samples, the worst relative
error, sleep and wake-up seconds per round. Exit status 1 when any sample is missing,
failed or wrong. About a minute on a warm H200 (vLLM 0.26, ``run.sh v30sleep``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS = [1, 2, 4]  # the tiny model has 4 layers; 4 is the last one, before the norm


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="batches, each followed by sleep")
    parser.add_argument("--prompts", type=int, default=32, help="requests per batch")
    parser.add_argument("--level", type=int, default=1, choices=[1], help="sleep level")
    parser.add_argument("--work", default="/tmp/hs-bench", help="where the tiny model is built")
    parser.add_argument("--storage", default="/tmp", help="parent of the output directory")
    parser.add_argument("--jsonl", default="", help="append the RESULT line here")
    return parser.parse_args()


def make_engine(model_dir: Path, out: str) -> Any:
    """The tiny bf16 model with sleep mode, prefix caching and small prefill chunks."""
    from vllm import LLM

    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    settings = {
        "chunk_bytes": 65536,  # small chunks and buffers: copies outlive generate()
        "host_buffer_bytes": 1 << 20,
        "checksum": True,
        "stats_interval": 0,
    }
    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        attention_backend="TRITON_ATTN",
        gpu_memory_utilization=0.3,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        enable_sleep_mode=True,
        seed=0,
        speculative_config=speculative_config(LAYERS),
        kv_transfer_config={
            **kv_transfer_config(out, settings),
            "kv_connector_module_path": "hidden_state_connector.connector",
        },
    )


def one_batch(llm: Any, round_no: int, count: int) -> list[Any]:
    """``count`` prompts of 17..1500 tokens; every other one stores 7 generated tokens."""
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(round_no)
    lengths = torch.randint(17, 1500, (count,), generator=gen).tolist()
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in lengths]
    params = []
    for i in range(count):
        transfer: dict[str, Any] = {"metadata": {"round": str(round_no), "index": str(i)}}
        with_output = i % 2 == 1
        if with_output:
            transfer["include_output_tokens"] = True
        params.append(
            SamplingParams(
                max_tokens=8 if with_output else 1,
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": transfer},
            )
        )
    return list(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The rounds, then the read-back and the comparison with HF."""
    from bench import _compare_with_hf

    from hidden_state_connector.apps.tiny_model import build_tiny_model
    from hidden_state_connector.engine import compat
    from hidden_state_reader import HiddenStateReader

    model_dir = build_tiny_model(Path(args.work) / "tiny-bfloat16", dtype="bfloat16")
    out = tempfile.mkdtemp(prefix="hs-sleep-", dir=args.storage)
    llm = make_engine(model_dir, out)
    outs: list[Any] = []
    rounds: list[int] = []
    sleep_s, wake_s = [], []
    errors: list[str | None] = []
    for round_no in range(args.rounds):
        batch = one_batch(llm, round_no, args.prompts)
        errors += [o.kv_transfer_params.get("hidden_states_error") for o in batch]
        outs += batch
        rounds += [round_no] * len(batch)
        started = time.monotonic()
        try:
            llm.sleep(level=args.level)  # right after generate(): copies may be in flight
        except RuntimeError as exc:  # recorded: the run then fails
            errors.append(f"round {round_no}: sleep raised {exc}")
        sleep_s.append(round(time.monotonic() - started, 3))
        started = time.monotonic()
        llm.wake_up()
        wake_s.append(round(time.monotonic() - started, 3))
    names = [os.path.basename(o.kv_transfer_params["hidden_states_path"]) for o in outs]
    read = HiddenStateReader(out, names=names, on_error="skip", verify_checksum=True)
    by_name = {os.path.basename(s.path): s for s in read}
    kept = [i for i, n in enumerate(names) if n in by_name]
    found = [outs[i] for i in kept]
    samples = [by_name[names[i]] for i in kept]
    tags_ok = all(by_name[names[i]].metadata.get("round") == str(rounds[i]) for i in kept)
    del llm
    worst, _, failures = _compare_with_hf(model_dir, found, samples, tol=3e-2)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "kind": "sleep",
        "vllm": compat.vllm_version(),
        "level": args.level,
        "rounds": args.rounds,
        "answered": len(outs),
        "read_back": len(samples),
        "missing": sorted(set(names) - set(by_name))[:10],
        "errors": [e for e in errors if e][:10],
        "tags_ok": tags_ok,
        "worst_rel_err": worst,
        "failures": failures[:10],
        "sleep_s": sleep_s,
        "wake_s": wake_s,
    }


def main() -> int:
    args = parse_args()
    # The engine core starts after this process used torch on the CPU (the tiny model):
    # spawn it rather than fork (a forked engine core once hung in an OpenMP barrier).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    result = run(args)
    line = "RESULT " + json.dumps(result)
    print(line, flush=True)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(line[7:] + "\n")
    ok = result["read_back"] == result["answered"] and not result["errors"]
    return 0 if ok and not result["failures"] and result["tags_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
