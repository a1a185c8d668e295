"""Offline: extract a dataset's hidden states with ``hidden-state extract``, then train on them.

What it shows:

* writing a small JSONL prompt file (plain text, chat messages and token ids mixed) and
  running ``hidden-state extract`` on it as a subprocess (offline vLLM; one file per
  record, ``hs_{index}.safetensors``, resumable through its ``manifest.jsonl``);
* training a small draft head for several epochs on the result with
  ``HiddenStateDataset(shuffle=True)`` + ``HiddenStateLoader`` (DataLoader workers,
  a new seeded order every epoch);
* checkpointing mid-epoch: ``loader.state_dict()`` saved next to the model and optimizer,
  a simulated crash, and a fresh loader resuming with ``loader.load_state_dict()``. The
  resumed run continues with exactly the sample the uninterrupted run would have read
  next (also with another ``num_workers``); the script checks that every epoch saw every
  sample exactly once, in the planned order.

Run it (CPU is fine; vLLM needs about 30 s to start)::

    python examples/offline_extract_then_train.py                 # tiny model, 48 prompts
    python examples/offline_extract_then_train.py --model ./my-model --layers 2,16,29 \\
        --num-prompts 1000 --workdir /data/run1

The extract step is the same as running, in a shell::

    hidden-state extract MODEL --input prompts.jsonl --out hs/ --layers 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hidden_state_connector.apps.draft_head import DraftHead, next_token_loss
from hidden_state_connector.apps.prompts import load_prompts
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, pad_collate, read_header


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run `hidden-state extract` on a prompt file, then train a draft head on "
        "the hidden states for several epochs with a mid-epoch checkpoint and resume.",
        epilog="example:\n  python examples/offline_extract_then_train.py --num-prompts 48 "
        "--epochs 2 --crash-at-step 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument(
        "--layers",
        default=None,
        help="layer ids, e.g. 2,16,29 (default: 1,2,4 for the tiny model, "
        "else EAGLE-3's low/middle/high)",
    )
    parser.add_argument(
        "--workdir", help="prompts.jsonl, hs/ and ckpt.pt go here (default: a new temp directory)"
    )
    parser.add_argument("--num-prompts", type=int, default=48, help="default 48")
    parser.add_argument("--epochs", type=int, default=2, help="default 2")
    parser.add_argument("--batch-size", type=int, default=4, help="default 4")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="save a checkpoint and stop at this optimizer step, then resume "
        "(default: the middle of the first epoch)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--cache-dir",
        default="~/.cache/hidden-state/demo",
        help="where the tiny model is built once (shared with hidden-state demo)",
    )
    return parser.parse_args(argv)


def write_prompts(path: Path, count: int) -> None:
    """The three record kinds ``hidden-state extract`` accepts."""
    texts = load_prompts(None, count)  # a few hundred short English texts ship with the package
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            if i % 3 == 1:  # rendered with the model's chat template
                record: dict = {"messages": [{"role": "user", "content": text}]}
            elif i % 3 == 2:  # already tokenized
                record = {"token_ids": list(text.encode("utf-8"))}  # byte ids: the tiny vocab
            else:
                record = {"text": text}
            f.write(json.dumps(record) + "\n")


def extract(model: str, prompts: Path, hs_dir: Path, layers: str | None) -> None:
    # Same as `hidden-state extract ...`; `python -m` just avoids depending on PATH.
    cmd = [
        sys.executable,
        "-m",
        "hidden_state_connector.apps.cli.extract",
        model,
        "--input",
        str(prompts),
        "--out",
        str(hs_dir),
        "--max-model-len",
        "1024",
    ]
    if layers:
        cmd += ["--layers", layers]
    print("running:", " ".join(cmd[1:]), flush=True)
    started = time.monotonic()
    env = {"VLLM_LOGGING_LEVEL": "WARNING", **os.environ}
    if os.path.isdir(model):
        env["HF_HUB_OFFLINE"] = "1"  # a local model: nothing to download
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    print(result.stdout.rstrip())
    if result.returncode != 0:  # 1: some samples failed (listed above) or vLLM failed
        sys.exit(f"extract failed with exit status {result.returncode}")
    print(f"extract took {time.monotonic() - started:.0f}s", flush=True)


def make_loader(hs_dir: Path, args: argparse.Namespace) -> HiddenStateLoader:
    # The sample list is taken here, once: files added later join only a new dataset.
    # shuffle=True draws a new order every epoch from seed + epoch, the same on every
    # rank and in every worker, which is what makes exact resume possible.
    dataset = HiddenStateDataset(hs_dir, shuffle=True, seed=1234)
    return HiddenStateLoader(
        dataset, batch_size=args.batch_size, collate_fn=pad_collate, num_workers=args.num_workers
    )


def save_checkpoint(
    ckpt: Path,
    head: DraftHead,
    optimizer: torch.optim.Optimizer,
    loader: HiddenStateLoader,
    step: int,
) -> None:
    """Save model, optimizer and reader position together."""
    # A checkpoint can be taken after any batch: the loader's state says which epoch and
    # how many of this rank's samples the loop has consumed.
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(),
            "step": step,
        },
        ckpt,
    )
    print(f"step {step}: checkpoint {loader.state_dict()} -> {ckpt.name}")


def load_checkpoint(
    ckpt: Path, head: DraftHead, optimizer: torch.optim.Optimizer, loader: HiddenStateLoader
) -> int:
    """Restore what ``save_checkpoint`` saved; the step it was taken at."""
    state = torch.load(ckpt)  # plain tensors and ints: weights_only loading works
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])  # epoch + samples consumed in it
    step = int(state["step"])
    print(
        f"resumed from {ckpt.name} at epoch {loader.epoch}, sample {loader.consumed} "
        f"of {len(loader.dataset)}, step {step}"
    )
    return step


def train(
    hs_dir: Path,
    ckpt: Path,
    vocab_size: int,
    args: argparse.Namespace,
    *,
    resume: bool,
    crash_at: int | None,
) -> dict[int, list[str]]:
    """Train until ``args.epochs`` are done (or until ``crash_at``); the names read, by epoch."""
    # Resuming works with another num_workers or batch_size too: the state is a position
    # in this rank's sample order, nothing about workers.
    loader = make_loader(hs_dir, args)
    first = read_header(hs_dir / loader.dataset.epoch_names(0)[0])  # shapes from a header
    torch.manual_seed(0)
    head = DraftHead(first.num_layers, first.hidden_size, vocab_size)
    optimizer = torch.optim.Adam(head.parameters(), lr=args.lr)
    step = load_checkpoint(ckpt, head, optimizer, loader) if resume else 0
    seen: dict[int, list[str]] = {}
    for epoch in range(loader.epoch, args.epochs):  # after a resume: the checkpoint's epoch
        # As with DistributedSampler. For the checkpoint's epoch this keeps the restored
        # position; the loop then reads only the rest of that epoch.
        loader.dataset.set_epoch(epoch)
        losses = []
        for batch in loader:
            seen.setdefault(epoch, []).extend(os.path.basename(p) for p in batch["paths"])
            loss, _ = next_token_loss(
                head(batch["hidden_states"]), batch["input_ids"], batch["attention_mask"]
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(loss.item())
            if step % 4 == 0:
                print(
                    f"step {step:3d}  epoch {epoch}  sample {loader.consumed:3d}/"
                    f"{len(loader.dataset)}  loss {losses[-1]:.3f}",
                    flush=True,
                )
            if step == crash_at:
                save_checkpoint(ckpt, head, optimizer, loader, step)
                print(f"step {step}: simulated crash (the rest of the epoch is not read)")
                return seen
        print(
            f"epoch {epoch} done: mean loss {sum(losses) / len(losses):.3f} over its "
            f"{len(losses)} steps in this run (step {step})",
            flush=True,
        )
    return seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hs-offline-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    hs_dir, prompts, ckpt = work / "hs", work / "prompts.jsonl", work / "ckpt.pt"
    model, layers = args.model, args.layers
    if model is None:
        cache = Path(os.path.expanduser(args.cache_dir))
        model = os.fspath(build_tiny_model(cache / "tiny-llama-bf16", dtype="bfloat16"))
        layers = layers or "1,2,4"
    vocab_size = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])

    write_prompts(prompts, args.num_prompts)
    extract(model, prompts, hs_dir, layers)  # rerun on the same workdir: "nothing to do"
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    loader = make_loader(hs_dir, args)
    steps_per_epoch = len(loader)
    crash_at = args.crash_at_step or max(1, steps_per_epoch // 2)
    print(
        f"{loader.dataset.num_samples} samples, {steps_per_epoch} steps per epoch; "
        f"crashing at step {crash_at}",
        flush=True,
    )

    before = train(hs_dir, ckpt, vocab_size, args, resume=False, crash_at=crash_at)
    after = train(hs_dir, ckpt, vocab_size, args, resume=True, crash_at=None)

    # The interrupted run plus the resumed one read each epoch exactly as planned.
    ok = True
    for epoch in range(args.epochs):
        got = before.get(epoch, []) + after.get(epoch, [])
        planned = loader.dataset.epoch_names(epoch)
        good = got == planned
        ok = ok and good
        print(
            f"epoch {epoch}: {len(got)} samples read across the crash, "
            f"{len(set(got))} distinct, planned order kept: {'OK' if good else 'MISMATCH'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
