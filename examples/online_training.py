"""Online training: a vLLM server writes hidden states while this script trains on them.

What it shows:

* starting ``vllm serve`` with the hidden-state connector from Python (``ServeOptions``
  and ``VllmServer``), or using a server that is already running (``--url``);
* sending prompts over the OpenAI API (``complete_all``) from a background thread;
* training a small EAGLE-style draft head in the same script on each sample as soon as
  the server publishes it: ``HiddenStateDataset(follow=True)`` (claims every file, so
  each one is trained on exactly once, and deletes it after use) + ``HiddenStateLoader``
  + ``pad_collate``;
* ending cleanly: the loop stops once the sample of every response has been trained on,
  then the server is stopped (also on Ctrl-C).

Run it (CPU is fine: the server needs about 30 s to start, then a few seconds)::

    python examples/online_training.py                      # tiny random model, 64 prompts
    python examples/online_training.py --model ./my-model --layers 2,16,29 --num-prompts 500

With a server you started yourself (``hidden-state serve ./my-model --out /data/hs``),
on a machine that sees the same /data/hs::

    python examples/online_training.py --url http://127.0.0.1:8000 --out /data/hs \\
        --model ./my-model

Each batch prints the loss of its first optimizer step, measured on samples the head has
never seen; it falls as the head learns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from hidden_state_connector.apps.draft_head import DraftHead, next_token_loss
from hidden_state_connector.apps.prompts import load_prompts
from hidden_state_connector.apps.server import ServeOptions, VllmServer, free_port
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_connector.client import complete_all
from hidden_state_connector.layers import default_layer_ids
from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, pad_collate

TINY_LAYERS = [1, 2, 4]  # low, middle and last (pre-norm) layer of the 4-layer tiny model
# What vLLM's CPU build needs to start quickly on a small machine.
CPU_VLLM_ARGS = [
    "--kv-cache-memory-bytes",
    str(512 * 1024**2),
    "--enforce-eager",
    "--max-num-batched-tokens",
    "256",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Start vLLM with the hidden-state connector, send prompts, and train a "
        "draft head on the hidden states while they are being written.",
        epilog="example:\n  python examples/online_training.py --num-prompts 64 --batch-size 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--layers", help="layer ids to capture, e.g. 2,16,29 (default: EAGLE-3's)")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument(
        "--out",
        help="hidden-state directory (default: a new temp directory); "
        "with --url: the server's shared_storage_path",
    )
    parser.add_argument("--served-model-name", help="with --url (default: asked from the server)")
    parser.add_argument("--vocab-size", type=int, help="with --url and no local --model")
    parser.add_argument("--prompts", help='JSONL file of {"text": ...} (default: bundled texts)')
    parser.add_argument("--num-prompts", type=int, default=64, help="default 64")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    parser.add_argument("--steps-per-batch", type=int, default=4, help="optimizer steps each")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="after the last response, wait this long for missing samples",
    )
    parser.add_argument(
        "--cache-dir",
        default="~/.cache/hidden-state/demo",
        help="where the tiny model is built once (shared with hidden-state demo)",
    )
    return parser.parse_args(argv)


def model_config(model: str) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    return {**config, **(config.get("text_config") or {})}


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])


class Producer(threading.Thread):
    """Sends the prompts; remembers which responses named a hidden-state file."""

    def __init__(self, url: str, model: str, prompts: list[str], concurrency: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompts, self.concurrency = url, model, prompts, concurrency
        self.paths: set[str] = set()
        self.failed = 0
        self.stop = threading.Event()
        self.finished_at: float | None = None

    def run(self) -> None:
        try:
            completions = complete_all(
                self.url, self.model, self.prompts, concurrency=self.concurrency, max_tokens=1
            )
            for completion in completions:  # in the order they finish
                if completion.path and completion.error is None:
                    self.paths.add(os.path.basename(completion.path))
                else:
                    self.failed += 1
                    print(f"prompt {completion.index} failed: {completion.error}", file=sys.stderr)
                if self.stop.is_set():
                    break
            completions.close()  # waits for the requests still in flight
        finally:
            self.finished_at = time.monotonic()


def train(args: argparse.Namespace, out_dir: str, producer: Producer, vocab_size: int) -> bool:
    """Train on the samples as they arrive; True when every produced sample was used."""
    # follow=True: read files as the server publishes them. Claims are on by default in
    # follow mode (each file goes to exactly one consumer: this process, its DataLoader
    # workers, or any other trainer on the same directory); on_consumed="delete" removes
    # each file once the loop is past its batch (docs/reader.md: what does a crash lose?).
    # idle_timeout ends one pass over the directory after a second without new files, so
    # the loop below can check whether more are coming.
    dataset = HiddenStateDataset(out_dir, follow=True, on_consumed="delete", idle_timeout=1.0)
    loader = HiddenStateLoader(
        dataset, batch_size=args.batch_size, collate_fn=pad_collate, num_workers=args.num_workers
    )
    head: DraftHead | None = None
    optimizer: torch.optim.Optimizer | None = None
    seen: set[str] = set()
    losses: list[float] = []
    last_news = time.monotonic()
    while True:
        for batch in loader:  # one pass: ends when the directory is idle for 1 s
            last_news = time.monotonic()
            hidden, input_ids, mask = (
                batch["hidden_states"],
                batch["input_ids"],
                batch["attention_mask"],
            )
            if head is None:  # size the head from the first batch: [B, T, layers, hidden]
                _, _, num_layers, hidden_size = hidden.shape
                head = DraftHead(num_layers, hidden_size, vocab_size)
                optimizer = torch.optim.Adam(head.parameters(), lr=args.lr)
            assert optimizer is not None
            seen.update(os.path.basename(p) for p in batch["paths"])
            for step in range(args.steps_per_batch):
                loss, _ = next_token_loss(head(hidden), input_ids, mask)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if step == 0:  # measured before training on this batch: unseen data
                    losses.append(loss.item())
            print(
                f"batch {len(losses):3d}  samples {len(seen):4d}/{len(producer.prompts)}  "
                f"tokens {int(batch['lengths'].sum()):5d}  loss {losses[-1]:.3f}",
                flush=True,
            )
        if producer.finished_at is not None:
            if len(seen) >= len(producer.paths):
                break
            if time.monotonic() - max(last_news, producer.finished_at) > args.drain_timeout:
                print(f"gave up waiting for {len(producer.paths - seen)} samples", file=sys.stderr)
                break
    report(seen, losses, producer)
    if args.num_workers == 0:  # (with worker processes, each worker counts for itself)
        stats = dataset.stats
        print(f"reader: {stats.yielded} samples read, {stats.skipped} skipped as unusable")
    return not (producer.paths - seen) and producer.failed == 0


def report(seen: set[str], losses: list[float], producer: Producer) -> None:
    """The run in one line: samples used, and the loss on unseen data, early vs late."""
    k = max(1, len(losses) // 4)
    if losses:
        print(
            f"trained on {len(seen)} samples ({len(producer.paths)} sent, {producer.failed} "
            f"failed), {len(losses)} batches; loss {sum(losses[:k]) / k:.3f} -> "
            f"{sum(losses[-k:]) / k:.3f} (mean of the first and last {k} batches)"
        )


def resolve_model(args: argparse.Namespace) -> tuple[str | None, int, list[int]]:
    """The model to serve (None with --url), the draft head's vocabulary, the layers."""
    tiny = args.model is None and args.url is None
    if tiny:
        cache = Path(os.path.expanduser(args.cache_dir))
        model = os.fspath(build_tiny_model(cache / "tiny-llama-bf16", dtype="bfloat16"))
    else:
        model = args.model
    if model is not None and os.path.isdir(model):
        config = model_config(model)
        vocab_size = int(config["vocab_size"])
    elif args.vocab_size:
        config, vocab_size = {}, args.vocab_size
    else:
        sys.exit("pass a local --model directory or --vocab-size (the draft head's vocabulary)")

    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
    elif tiny:
        layers = TINY_LAYERS
    elif "num_hidden_layers" in config:
        layers = default_layer_ids(int(config["num_hidden_layers"]))  # EAGLE-3's choice
    elif not args.url:
        sys.exit("--layers is needed when --model is not a local directory")
    else:
        layers = []  # a running server (--url) already knows its layers
    return model, vocab_size, layers


def start_server(model: str | None, out_dir: str, layers: list[int], name: str) -> VllmServer:
    """Start ``vllm serve`` with the connector writing to ``out_dir``; wait until ready."""
    assert model is not None
    vllm_args = ["--max-model-len", "2048", "--served-model-name", name]
    vllm_args += CPU_VLLM_ARGS if not torch.cuda.is_available() else []
    options = ServeOptions(
        model=model,
        out_dir=out_dir,
        layer_ids=layers,
        port=free_port(),
        vllm_args=vllm_args,
    )
    print(f"starting: {options.shell_command()}", flush=True)
    env = {"HF_HUB_OFFLINE": "1"} if os.path.isdir(model) else {}  # nothing to download
    server = VllmServer(options, log_file=os.path.join(out_dir, "server.log"), env=env)
    started = time.monotonic()
    server.start(timeout=600)  # raises with the end of the server log if it fails
    print(f"server ready after {time.monotonic() - started:.0f}s at {server.url}", flush=True)
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and not args.out:
        sys.exit("--url needs --out: the directory that server writes to")
    out_dir = os.path.abspath(args.out or tempfile.mkdtemp(prefix="hs-online-"))
    os.makedirs(out_dir, exist_ok=True)
    prompts = load_prompts(args.prompts, args.num_prompts)

    model, vocab_size, layers = resolve_model(args)

    server: VllmServer | None = None
    producer: Producer | None = None
    ok: bool | None = False
    try:
        if args.url:
            url = args.url.rstrip("/")
            name = args.served_model_name or served_model_name(url)
        else:
            name = "hs-example"
            server = start_server(model, out_dir, layers, name)
            url = server.url
            if not torch.cuda.is_available():
                torch.set_num_threads(1)  # leave the other cores to the server
        producer = Producer(url, name, prompts, args.concurrency)
        producer.start()
        ok = train(args, out_dir, producer, vocab_size)
    except KeyboardInterrupt:
        print("interrupted, stopping cleanly", file=sys.stderr)
        ok = None
    finally:
        if producer is not None:  # send nothing more; let the requests in flight finish
            producer.stop.set()
            producer.join(timeout=60)
        if server is not None:
            code = server.stop()  # SIGINT first: vLLM shuts down cleanly
            print(f"server stopped (exit code {code}); log: {server.log_path}")
    left = [f for f in os.listdir(out_dir) if f.endswith(".safetensors")]
    print(f"hidden-state files left in {out_dir}: {len(left)}")
    if ok and not args.out:
        shutil.rmtree(out_dir)  # a temporary directory holding only server.log now
    return 130 if ok is None else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
