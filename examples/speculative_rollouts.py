"""Capture hidden states beside a drafter, then filter or weight samples by acceptance.

What it shows:

* **Capture while speculating**: forward capture (``"capture": "forward"``) in an engine
  that runs speculative decoding (here ngram prompt lookup, ``speculative_config=
  {"method": "ngram", ...}``), as RL rollouts do. Each sample stores the target model's
  rows of the prompt and the generated tokens fed back: the same tokens and values as
  without the drafter; rejected drafts leave nothing behind.
* **Acceptance per sample**: each sample with generated tokens records how many draft
  tokens the target verified and how many it accepted (``num_draft_tokens``,
  ``num_accepted_tokens``); ``sample_acceptance(sample.metadata)`` reads them.
* **A trainer's use**: keep the samples whose acceptance rate is at least
  ``--min-rate`` (where the drafter already does well, or, inverted, where it needs
  training), or weight each sample by its rate.

One offline ``LLM`` (a tiny random float32 Llama built locally, or ``--model``),
repetitive prompts (drafts accepted) and random ones, then every sample read back.

Run it::

    python examples/speculative_rollouts.py                  # tiny random model, CPU or GPU
    python examples/speculative_rollouts.py --min-rate 0.8 --out /tmp/hs
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from hidden_state_connector.apps.server import kv_transfer_config
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.format import sample_acceptance


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python examples/speculative_rollouts.py --min-rate 0.5",
    )
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--layers", default="1,2,4", help="layer ids to capture")
    parser.add_argument("--out", help="directory for the samples (default: a temporary one)")
    parser.add_argument("--requests", type=int, default=6, help="requests (half repetitive)")
    parser.add_argument("--min-rate", type=float, default=0.9, help="acceptance rate to keep")
    parser.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "hidden-state-demo"),
        help="where the tiny model is built once",
    )
    return parser.parse_args()


def prompts(count: int) -> list[list[int]]:
    """Half repetitive (ngram drafts match), half random token ids."""
    rng = random.Random(0)
    found = []
    for i in range(count):
        if i % 2 == 0:
            found.append([10 + i + j % (3 + i) for j in range(60)])
        else:
            found.append([rng.randrange(3, 250) for _ in range(40)])
    return found


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    model = args.model or os.fspath(
        build_tiny_model(Path(args.cache_dir) / "tiny-llama-fp32", dtype="float32")
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="speculative-"))
    llm = LLM(
        model=model,
        max_model_len=256,
        enforce_eager=True,
        async_scheduling=False,  # forward capture beside a drafter needs it off
        kv_cache_memory_bytes=128 * 1024**2,  # the CPU build reserves host RAM
        skip_tokenizer_init=True,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        kv_transfer_config=kv_transfer_config(
            os.fspath(out),
            {
                "capture": "forward",
                "layer_ids": [int(x) for x in args.layers.split(",")],
                "include_output_tokens": True,  # the rollout's generated tokens too
                "stats_interval": 0,
            },
        ),
    )
    params = SamplingParams(max_tokens=32, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(args.requests)], params)
    names = [os.path.basename(str(o.kv_transfer_params["hidden_states_path"])) for o in outputs]
    report(out, names, args.min_rate)


def report(out: Path, names: list[str], min_rate: float) -> None:
    """Read the samples back; keep those whose drafts were accepted often enough."""
    kept, weights = [], {}
    for sample in HiddenStateReader(out, names=names, on_error="raise"):  # waits for writers
        counts = sample_acceptance(sample.metadata)
        if counts is None or counts.rate is None:
            continue  # no speculation recorded (prompt-only sample, or nothing drafted)
        name = os.path.basename(sample.path)
        tokens, accepted, drafted = len(sample.token_ids), counts.accepted, counts.drafted
        print(f"{name}: {tokens} tokens, accepted {accepted} of {drafted} drafts")
        weights[name] = counts.rate  # e.g. a loss weight
        if counts.rate >= min_rate:
            kept.append(name)
    print(f"kept {len(kept)} of {len(weights)} samples with acceptance rate >= {min_rate}")
    mean = sum(weights.values()) / max(1, len(weights))
    print(f"mean acceptance rate {mean:.2f}")


if __name__ == "__main__":
    main()
