"""Tag each sample with where it came from, and retry requests without making duplicates.

What it shows:

* **RL rollouts**: every request of a rollout batch carries the policy version that
  produced it, ``kv_transfer_params={"metadata": {"policy_version": "step-100"}}``;
  a trainer reads it back as ``sample.metadata["policy_version"]`` and can drop stale
  rollouts.
* **A dataset**: every request carries its row id, ``{"metadata": {"row_id": "..."}}``,
  so a sample can be joined back to its source row.
* **Retries**: with ``{"idempotency_key": KEY}`` the sample is named ``KEY.safetensors``.
  A retried request with the same key (say, after the client saw a connection reset)
  finds the first sample complete and writes nothing (its response says
  ``hidden_states_existed``): one sample per key, however often a request is sent.

One offline ``LLM`` with the connector (a tiny random Llama built locally, or
``--model``), two batches and a retry of the first; then every sample is read back
and checked.

Run it::

    python examples/tagged_rollouts.py                   # tiny random model, CPU or GPU
    python examples/tagged_rollouts.py --out /tmp/hs --model ./my-model
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_reader import HiddenStateReader

TINY_LAYERS = [1, 2, 4]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python examples/tagged_rollouts.py --rollouts 4",
    )
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--layers", default="1,2,4", help="layer ids to capture")
    parser.add_argument("--out", help="directory for the samples (default: a temporary one)")
    parser.add_argument("--rollouts", type=int, default=4, help="rollout requests per batch")
    parser.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "hidden-state-demo"),
        help="where the tiny model is built once",
    )
    return parser.parse_args()


def rollout_params(policy_version: str, rollout: int) -> dict[str, object]:
    """One rollout request's kv_transfer_params: its policy version and a retry-safe name."""
    return {
        "metadata": {"policy_version": policy_version, "rollout": str(rollout)},
        "idempotency_key": f"{policy_version}.rollout-{rollout}",
    }


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    model = args.model or os.fspath(
        build_tiny_model(Path(args.cache_dir) / "tiny-llama-fp32", dtype="float32")
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="tagged-"))
    llm = LLM(
        model=model,
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=128 * 1024**2,  # the CPU build reserves host RAM
        skip_tokenizer_init=True,
        speculative_config=speculative_config([int(x) for x in args.layers.split(",")]),
        kv_transfer_config=kv_transfer_config(os.fspath(out), {"stats_interval": 0}),
    )
    prompts = [
        {"prompt_token_ids": [(7 * r + j) % 200 + 1 for j in range(24)]}
        for r in range(args.rollouts)
    ]

    def send(policy_version: str) -> list[dict[str, object]]:
        params = [
            SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": rollout_params(policy_version, r)}
            )
            for r in range(args.rollouts)
        ]
        return [o.kv_transfer_params for o in llm.generate(prompts, params, use_tqdm=False)]

    first = send("step-100")
    names = [os.path.basename(str(r["hidden_states_path"])) for r in first]
    read = list(HiddenStateReader(out, names=names, on_error="raise"))  # waits for the writer
    print(f"batch of policy step-100: {len(read)} samples, e.g. {names[0]}")
    retried = send("step-100")  # the same requests again, as a client that retries
    existed = sum(bool(r.get("hidden_states_existed")) for r in retried)
    print(f"retry of the same batch: {existed} of {len(retried)} found complete, nothing rewritten")
    send("step-200")
    # A dataset row: its id is the tag (and the key, so re-running the job is a no-op).
    row = SamplingParams(
        max_tokens=1,
        extra_args={
            "kv_transfer_params": {
                "metadata": {"row_id": "train-000042"},
                "idempotency_key": "train-000042",
            }
        },
    )
    llm.generate([{"prompt_token_ids": list(range(1, 30))}], row, use_tqdm=False)

    report(out, distinct_keys=2 * args.rollouts + 1)


def report(out: Path, distinct_keys: int) -> None:
    """Read every sample back: rollouts counted per policy version, dataset rows by id."""
    by_policy: dict[str, int] = {}
    for sample in HiddenStateReader(out, on_error="raise"):
        version = sample.metadata.get("policy_version")
        if version is not None:
            by_policy[version] = by_policy.get(version, 0) + 1
        else:
            row_id, n = sample.metadata["row_id"], sample.num_tokens
            print(f"dataset sample {Path(sample.path).name}: row_id={row_id}, {n} tokens")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"samples per policy version: {dict(sorted(by_policy.items()))}")
    print(f"{len(files)} files for {distinct_keys} distinct keys")


if __name__ == "__main__":
    main()
