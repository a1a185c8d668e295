"""DDP with torchrun: every rank trains on its own share of one hidden-state directory.

What it shows:

* ``HiddenStateDataset`` finds its rank and the world size by itself (from the process
  group that torchrun's environment sets up) and reads only this rank's share of each
  epoch, in a seeded order that every rank computes identically;
* ``even_shards=True`` (the default) pads each rank's share to the same length, so all
  ranks run the same number of steps and no rank waits forever in an all-reduce;
* ``HiddenStateLoader`` with persistent DataLoader workers and ``set_epoch`` each epoch,
  ``DistributedDataParallel`` around a small draft head, the gloo backend (CPU);
* rank 0 prints the loss averaged over all ranks.

Without ``--data`` it first writes a synthetic dataset (``--make-data N`` samples, with
``write_sample``) into a temporary directory, so it runs anywhere. Only
``hidden_state_reader`` is needed (no vLLM).

Run it::

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py                   # synthetic data
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --data /data/hs --epochs 3
    python examples/ddp_torchrun.py                                        # one process

On GPUs use ``--backend nccl`` (each rank then trains on ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hidden_state_reader import (
    HiddenStateDataset,
    HiddenStateLoader,
    pad_collate,
    read_header,
    write_sample,
)

SYNTHETIC_VOCAB = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DistributedDataParallel training on a hidden-state directory, each rank "
        "reading its own share (run under torchrun).",
        epilog="example:\n  torchrun --nproc-per-node 2 examples/ddp_torchrun.py --make-data 64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", help="hidden-state directory (default: synthetic data)")
    parser.add_argument(
        "--make-data",
        type=int,
        default=64,
        metavar="N",
        help="without --data: write N synthetic samples first (default 64)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="the model's vocabulary (needed with --data; the synthetic data uses 64)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPU)")
    return parser.parse_args(argv)


class DraftHead(nn.Module):
    """A minimal draft head: fuse the captured layers, predict the next token."""

    def __init__(self, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_layers * hidden_size, hidden_size),
            nn.GELU(),
            nn.Linear(hidden_size, vocab_size),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [B, T, L, H] -> [B, T, V]
        return self.net(hidden_states.float().flatten(2))


def next_token_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Cross-entropy of predicting token t + 1 at position t; padding is never a label."""
    labels = batch["input_ids"][:, 1:].clone()
    mask = batch["attention_mask"]
    labels[~(mask[:, 1:] & mask[:, :-1])] = -100
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


def make_synthetic(directory: str, count: int, layers: int = 3, hidden: int = 32) -> None:
    """Samples whose next token is a function of the current one, so the head can learn."""
    generator = torch.Generator().manual_seed(0)
    # Each token's "hidden states": a fixed random vector per layer, plus noise below.
    table = torch.randn(SYNTHETIC_VOCAB, layers, hidden, generator=generator)
    for i in range(count):
        length = 8 + i % 25  # varied lengths: pad_collate pads each batch to its longest
        ids = torch.empty(length, dtype=torch.int64)
        ids[0] = i % SYNTHETIC_VOCAB
        for t in range(1, length):
            ids[t] = (ids[t - 1] * 5 + 3) % SYNTHETIC_VOCAB
        states = table[ids] + 0.1 * torch.randn(length, layers, hidden, generator=generator)
        write_sample(os.path.join(directory, f"hs_{i}.safetensors"), ids, states.bfloat16())


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (or make a one-process group)."""
    if "RANK" not in os.environ:  # plain `python ddp_torchrun.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # no oversubscription
    return rank, world, device


def prepare_data(args: argparse.Namespace, rank: int) -> tuple[str, str | None]:
    """The data directory, and the one this run made (to remove at the end), if any."""
    data, made = args.data, None
    if data is None:
        # Rank 0 writes the data; everyone learns where and waits until it is there.
        path = [tempfile.mkdtemp(prefix="hs-ddp-") if rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        data = made = path[0]
        if rank == 0:
            make_synthetic(data, args.make_data)
            print(f"wrote {args.make_data} synthetic samples to {data}", flush=True)
    # The static sample list is taken when the dataset is built: every rank must see the
    # same files then (hence the barrier after writing them).
    dist.barrier()
    return data, made


def train_epoch(
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    loader: HiddenStateLoader,
    device: torch.device,
) -> tuple[torch.Tensor, int, list[str]]:
    """One epoch on this rank: (loss sum and step count, steps, sample names read)."""
    names: list[str] = []
    total, steps = torch.zeros(2, dtype=torch.float64), 0
    for batch in loader:
        names += [os.path.basename(p) for p in batch["paths"]]
        logits = model(batch["hidden_states"].to(device))
        loss = next_token_loss(
            logits, {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        steps += 1
    return total, steps, names


def report_epoch(
    epoch: int,
    total: torch.Tensor,
    steps: int,
    names: list[str],
    rank: int,
    world: int,
    num_samples: int,
) -> None:
    """Logging only: the mean loss over all ranks, and what each rank read."""
    dist.all_reduce(total)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, (steps, names))
    if rank == 0:
        step_counts = [s for s, _ in per_rank]
        covered = {n for _, ns in per_rank for n in ns}
        print(
            f"epoch {epoch}: loss {total[0] / total[1]:.3f}  steps per rank "
            f"{step_counts}  samples covered {len(covered)}/{num_samples}",
            flush=True,
        )


def main() -> int:
    args = parse_args()
    if args.data is not None and args.vocab_size is None:
        sys.exit("--data needs --vocab-size (the vocab_size of the model that wrote the data)")
    vocab_size = args.vocab_size or SYNTHETIC_VOCAB
    rank, world, device = setup(args)
    data, made = prepare_data(args, rank)

    # rank / world_size are detected from the process group. even_shards=True (default)
    # pads every rank's share to ceil(N / world) by wrapping around, like DistributedSampler.
    dataset = HiddenStateDataset(data, shuffle=True, seed=0)
    loader = HiddenStateLoader(
        dataset,
        batch_size=args.batch_size,
        collate_fn=pad_collate,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,  # set_epoch reaches them through shared memory
    )
    if rank == 0:
        print(
            f"{dataset.num_samples} samples, {world} ranks: {len(dataset)} per rank and "
            f"epoch, {len(loader)} steps",
            flush=True,
        )

    header = read_header(os.path.join(data, dataset.epoch_names()[0]))  # shapes, no data read
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    head = DraftHead(header.num_layers, header.hidden_size, vocab_size).to(device)
    model = DistributedDataParallel(head)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        total, steps, names = train_epoch(model, optimizer, loader, device)
        report_epoch(epoch, total, steps, names, rank, world, dataset.num_samples)
    # One checkpoint per rank would hold loader.state_dict() of that rank (positions are
    # per rank), next to the model state that rank 0 saves.
    dist.barrier()
    dist.destroy_process_group()
    if made and rank == 0:
        shutil.rmtree(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
