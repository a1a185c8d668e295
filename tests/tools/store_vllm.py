"""vLLM CPU with ``storage_backend="mooncake"``: generate, then read every sample back.

    python -m tools.store_vllm MODEL_DIR MASTER PREFIX

Runs inside the store test's namespace. The engine hosts no store memory (the segment
host does); each request's ``kv_transfer_params`` names its sample's store key, and a
``HiddenStateReader`` on the store URL pulls exactly those keys. Prints one JSON line:
per request, the key and the largest relative error of each captured layer against HF
transformers' hidden states for the same tokens; then a keyed request retried after a
deleting reader consumed it (``keyed_retries``). The engine runs in this process (vLLM's
in-process mode: one vLLM import instead of three on the CPU build), so the connector's
store client and the reader's are two clients of one process.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
from typing import Any

import torch

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.format.store_keys import data_key
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.url import parse_store_url

from procs import IN_PROCESS_ENGINE

LAYERS = [1, 2, 4]


def main() -> None:
    model, master, prefix = sys.argv[1:4]
    os.environ.update(IN_PROCESS_ENGINE)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model, dtype="float32", max_model_len=512, enforce_eager=True,
        kv_cache_memory_bytes=256 * 1024**2, skip_tokenizer_init=True, seed=0,
        speculative_config=speculative_config(LAYERS),
        # No shared_storage_path (as `hidden-state serve --storage mooncake` starts it).
        kv_transfer_config=kv_transfer_config(None, {
            "storage_backend": "mooncake", "mooncake_master": master,
            "mooncake_prefix": prefix, "mooncake_local_hostname": "127.0.0.1",
            "mooncake_buffer_bytes": "64MiB", "num_writer_threads": 2, "stats_interval": 0,
        }),
    )  # fmt: skip
    prompts = [[(7 * i + j) % 200 + 5 for j in range(n)] for i, n in enumerate((9, 24, 70))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, temperature=0))  # fmt: skip
    params = [dict(o.kv_transfer_params or {}) for o in outputs]
    keys = [p["hidden_states_key"] for p in params]
    url = f"mooncake://{master}/{prefix}?hostname=127.0.0.1"
    # names= yields samples as they complete, and puts finish in any order: match by key.
    reader = HiddenStateReader(url, names=keys, lock_timeout=60, on_error="raise")
    by_key = {s.path.rsplit("/", 1)[-1]: s for s in reader}
    samples = [by_key[k] for k in keys]
    retries = keyed_retries(llm, prompts[0], url)
    del llm
    gc.collect()
    errors = compare(model, samples)
    print(json.dumps({"params": params, "prompts": prompts, "errors": errors,
                      "tokens": [s.token_ids.tolist() for s in samples],
                      "layer_ids": [s.layer_ids for s in samples],
                      "retries": retries}), flush=True)  # fmt: skip


def keyed_retries(llm: Any, prompt: list[int], url: str) -> dict[str, Any]:
    """A keyed request, consumed by a deleting reader, retried: within its key's
    retention (nothing written), then after ``hidden-state clean`` forgot the key."""
    from vllm import SamplingParams

    from hidden_state_reader.apps.cli.main import main as cli

    def request() -> dict[str, Any]:
        params = SamplingParams(
            max_tokens=1,
            temperature=0,
            extra_args={"kv_transfer_params": {"idempotency_key": "row-1"}},
        )
        return dict(llm.generate([{"prompt_token_ids": prompt}], params)[0].kv_transfer_params)

    def take(key: str) -> list[list[int]]:
        reader = HiddenStateReader(
            url, names=[key], lock_timeout=60, on_error="raise", on_consumed="delete"
        )
        return [s.token_ids.tolist() for s in reader]

    out: dict[str, Any] = {"first": request()}
    key = out["first"]["hidden_states_key"]
    out["taken"] = take(key)
    client = StoreClient(parse_store_url(url))
    out["retry"] = request()
    out["stored_after_retry"] = client.exists([data_key(client.settings.prefix, key)])[0]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        cli(["clean", url, "--consumed-keys-older-than", "0", "--json"])
    out["forgotten"] = [f["path"] for f in json.loads(printed.getvalue())["files"]]
    out["after_clean"] = request()
    out["taken_again"] = take(key)
    client.close()
    return out


def compare(model: str, samples: list) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    errors = []
    with torch.no_grad():
        for s in samples:
            out = hf(s.token_ids[None], output_hidden_states=True).hidden_states
            row = []
            for pos, layer in enumerate(s.layer_ids):
                # The last layer is captured before the final norm: compare the others.
                if layer < len(out) - 1:
                    want, got = out[layer][0], s.hidden_states[:, pos].float()
                    row.append(float((got - want).norm() / want.norm()))
            errors.append(row)
    return errors


if __name__ == "__main__":
    main()
