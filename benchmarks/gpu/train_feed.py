"""Does the loader keep a GPU drafter trainer busy? One trainer, several feeds, one call.

    python benchmarks/gpu/train_feed.py --jsonl results/DATE.jsonl            # every row
    python benchmarks/gpu/train_feed.py --rows synthetic,hsl_bf16_static --seconds 10
    python benchmarks/gpu/train_feed.py --help

The trainer is an EAGLE-3-shaped draft head at Llama-3.1-8B dimensions: ``fc`` from
3 x 4096 captured values to 4096, one decoder layer (width 4096, 32 heads, MLP 14,336),
a draft lm_head of 32,000, and a frozen verifier norm + lm_head of 128,256 that makes the
targets from the 4th captured layer; bf16, AdamW, one step per packed batch of up to
16,384 tokens. Samples are 2k-6k tokens (mean 4k) with 4 captured layers, written once
with the product's writer (bf16 and fp8 storage) and read from the page cache.

Feeds: ``synthetic`` (a batch already on the GPU: the ceiling), ``HiddenStateLoader``
with ``device="cuda"`` (builder threads) and without (DataLoader worker processes,
``pin_memory=True``), static and follow mode (a producer thread hard-links files into
the followed directory; readers claim and delete), and a ``safetensors.load_file``
map-style Dataset through the same DataLoader settings (speculators' offline trainer).
Every feed also runs alone (``*_alone`` rows: batches into GPU memory, no training).

One JSON line per row (``kind: "train_feed"``) is printed after ``RESULT `` and appended
to ``--jsonl``: feed, mode, storage_dtype, workers, tok_s, tok_s_synthetic (this call),
ratio_vs_synthetic, data_wait_frac, loader_gb_s, host_cpu_s_per_gb.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 -- the usual name

HIDDEN, HEADS, MLP, DRAFT_VOCAB, VOCAB, LAYERS = 4096, 32, 14336, 32000, 128256, 4
PACK_TOKENS = 16384
BATCH_SAMPLES = 4  # --batch-samples


# ----------------------------------------------------------------------------- trainer


class DraftHead(nn.Module):
    """EAGLE-3-shaped: fused aux layers -> one decoder layer -> draft lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(DRAFT_VOCAB, HIDDEN)
        self.fc = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
        self.norm1 = nn.RMSNorm(2 * HIDDEN)
        self.qkv = nn.Linear(2 * HIDDEN, 3 * HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm2 = nn.RMSNorm(HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 2 * MLP, bias=False)
        self.down = nn.Linear(MLP, HIDDEN, bias=False)
        self.norm3 = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, DRAFT_VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        n = aux.shape[0]
        x = self.fc(aux)
        h = self.norm1(torch.cat([self.embed(input_ids % DRAFT_VOCAB), x], dim=-1))
        q, k, v = self.qkv(h).view(n, 3, HEADS, HIDDEN // HEADS).permute(1, 2, 0, 3)
        att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
        x = x + self.o(att[0].transpose(0, 1).reshape(n, HIDDEN))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.lm_head(self.norm3(x))


class Trainer:
    """The draft head, its optimizer and the frozen verifier head that makes targets."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model = DraftHead().to(device, torch.bfloat16)
        self.verifier_norm = nn.RMSNorm(HIDDEN).to(device, torch.bfloat16).requires_grad_(False)
        self.verifier_head = (
            nn.Linear(HIDDEN, VOCAB, bias=False).to(device, torch.bfloat16).requires_grad_(False)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One optimizer step on ``hidden`` ``[N, 4, 4096]`` and its ``input_ids`` ``[N]``."""
        n = hidden.shape[0]
        with torch.no_grad():
            target = self.verifier_head(self.verifier_norm(hidden[:, 3])).argmax(-1)
            target = target % DRAFT_VOCAB
        logits = self.model(input_ids, hidden[:, :3].reshape(n, 3 * HIDDEN))
        loss = F.cross_entropy(logits[:-1].float(), target[1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


# ----------------------------------------------------------------------------- data


def write_dataset(root: Path, unique: int, copies: int, fp8: bool, device: torch.device) -> int:
    """``unique`` random samples (2k-6k tokens) written ``copies`` times (hard links)."""
    from hidden_state_reader.files.locks import WriterLock
    from hidden_state_reader.files.publish import SampleFileWriter
    from hidden_state_reader.format import fp8 as fp8_format
    from hidden_state_reader.format import sample_metadata
    from hidden_state_reader.kernels.fp8 import quantize

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    total = 0
    for i in range(unique):
        tokens = int(torch.randint(2048, 6145, (1,), generator=gen))
        hidden = torch.randn(tokens, LAYERS, HIDDEN, device=device, dtype=torch.bfloat16)
        token_ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
        meta = sample_metadata(layer_ids=[2, 16, 29, 32], request_id=f"r{i}")
        path = str(root / f"u{i:04d}.safetensors")
        storage = fp8_format.STORAGE_FP8 if fp8 else fp8_format.STORAGE_MODEL
        writer = SampleFileWriter(
            path,
            token_ids=token_ids,
            hidden_shape=(tokens, LAYERS, HIDDEN),
            hidden_dtype=torch.bfloat16,
            metadata=meta,
            lock=WriterLock.create(path),
            checksum=True,
            storage=storage,
        )
        if fp8:  # quantized on the GPU (the CPU takes minutes for this much)
            codes, scales = quantize(hidden)
            writer.write_scales(scales.cpu())
            writer.write_hidden(codes.cpu())
        else:
            writer.write_hidden(hidden.cpu())
        writer.publish()
        for c in range(1, copies):
            os.link(path, root / f"u{i:04d}c{c}.safetensors")
        total += tokens * copies
    return total


class Producer:
    """A process that hard-links pool files into a followed directory (``backlog`` waiting).

    A process of its own, as vLLM is: it takes no time from the trainer's interpreter.
    """

    def __init__(self, pool: Path, target: Path, backlog: int = 48) -> None:
        import multiprocessing

        self.files = sorted(pool.glob("*.safetensors"))
        self.target, self.backlog = target, backlog
        target.mkdir(parents=True, exist_ok=True)
        context = multiprocessing.get_context("fork")
        self.stop = context.Event()
        self.process = context.Process(target=self._run, daemon=True)

    def start(self) -> None:
        self.process.start()

    def close(self) -> None:
        self.stop.set()
        self.process.join()

    def _run(self) -> None:
        made = 0
        while not self.stop.is_set():
            waiting = sum(1 for n in os.listdir(self.target) if n.endswith(".safetensors"))
            if waiting >= self.backlog:
                time.sleep(0.005)
                continue
            src = self.files[made % len(self.files)]
            os.link(src, self.target / f"f{made:07d}.safetensors")
            made += 1


# ----------------------------------------------------------------------------- feeds


def _to_gpu(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def hsl_batches(root: Path, args: argparse.Namespace, spec: dict[str, Any]) -> Iterator[Any]:
    """HiddenStateLoader batches forever (epoch after epoch), on the GPU."""
    from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, PackCollate

    device = torch.device("cuda")
    collate = PackCollate(max_tokens=PACK_TOKENS)
    opts: dict[str, Any] = dict(spec.get("reader", {}))
    if spec["mode"] == "follow":
        opts.update(follow=True, claim=True, on_consumed="delete", idle_timeout=30)
    dataset = HiddenStateDataset(root, shuffle=spec["mode"] == "static", **opts)
    kwargs: dict[str, Any] = {"num_workers": spec["workers"]}
    if spec["threads"]:
        kwargs["device"] = device
    else:
        kwargs.update(pin_memory=True, prefetch_factor=4, persistent_workers=True)
    loader = HiddenStateLoader(dataset, BATCH_SAMPLES, collate_fn=collate, **kwargs)
    dequantize = spec.get("gpu_dequantize", False)
    while True:
        for batch in loader:
            if not spec["threads"]:
                batch = _to_gpu(batch, device)
            if dequantize:
                from hidden_state_reader.kernels import fp8

                batch["hidden_states"] = fp8.dequantize(
                    batch["hidden_states"], batch.pop("hidden_states_scales"), torch.bfloat16
                )
            yield batch


def safetensors_batches(
    root: Path, args: argparse.Namespace, spec: dict[str, Any]
) -> Iterator[Any]:
    """A map-style Dataset of ``safetensors.torch.load_file`` through a DataLoader."""
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader, Dataset

    from hidden_state_reader import PackCollate

    files = sorted(str(p) for p in root.glob("*.safetensors"))

    class Files(Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = load_file(files[i])
            return t["token_ids"], t["hidden_states"]

    loader = DataLoader(
        Files(),
        batch_size=BATCH_SAMPLES,
        shuffle=True,
        collate_fn=PackCollate(max_tokens=PACK_TOKENS),
        num_workers=spec["workers"],
        pin_memory=True,
        prefetch_factor=4,
        persistent_workers=True,
    )
    device = torch.device("cuda")
    while True:
        for batch in loader:
            yield _to_gpu(batch, device)


def synthetic_batches(root: Path, args: argparse.Namespace, spec: dict[str, Any]) -> Iterator[Any]:
    device = torch.device("cuda")
    batch = {
        "input_ids": torch.randint(0, VOCAB, (1, PACK_TOKENS), device=device),
        "hidden_states": torch.randn(1, PACK_TOKENS, LAYERS, HIDDEN, device=device).bfloat16(),
    }
    while True:
        yield batch


def synthetic_varlen_batches(
    root: Path, args: argparse.Namespace, spec: dict[str, Any]
) -> Iterator[Any]:
    """Resident batches with the token counts the loader's packs have (the fair ceiling).

    Packs of ``BATCH_SAMPLES`` shuffled samples of the data set, capped at
    ``PACK_TOKENS``, as ``PackCollate(max_tokens=...)`` makes them: the trainer's speed
    depends on the shapes it gets, so the loader rows compare with the same shapes.
    """
    from hidden_state_reader.files.header import read_header

    lengths = [read_header(str(p)).num_tokens for p in sorted(root.glob("*.safetensors"))]
    gen = torch.Generator().manual_seed(2)
    device = torch.device("cuda")
    ids = torch.randint(0, VOCAB, (1, PACK_TOKENS), device=device)
    hidden = torch.randn(1, PACK_TOKENS, LAYERS, HIDDEN, device=device).bfloat16()
    while True:
        order = torch.randperm(len(lengths), generator=gen).tolist()
        for start in range(0, len(order) - BATCH_SAMPLES + 1, BATCH_SAMPLES):
            n = min(PACK_TOKENS, sum(lengths[i] for i in order[start : start + BATCH_SAMPLES]))
            yield {"input_ids": ids[:, :n], "hidden_states": hidden[:, :n]}


FEEDS: dict[str, Callable[..., Iterator[Any]]] = {
    "synthetic_varlen": synthetic_varlen_batches,
    "hidden_state_loader": hsl_batches,
    "safetensors": safetensors_batches,
    "synthetic": synthetic_batches,
}


def row_specs() -> dict[str, dict[str, Any]]:
    """Every row this benchmark knows, by name."""
    rows: dict[str, dict[str, Any]] = {
        "synthetic": {"feed": "synthetic", "mode": "static", "storage": "model", "workers": 0},
        "synthetic_varlen": {
            "feed": "synthetic_varlen",
            "mode": "static",
            "storage": "model",
            "workers": 0,
        },
    }
    for storage in ("model", "fp8_e4m3"):
        tag = "bf16" if storage == "model" else "fp8"
        for mode in ("static", "follow"):
            rows[f"hsl_{tag}_{mode}"] = {
                "feed": "hidden_state_loader", "mode": mode, "storage": storage,
                "workers": 4, "threads": True, "path": "device_feed",
            }  # fmt: skip
        rows[f"dl_{tag}_static"] = {
            "feed": "hidden_state_loader", "mode": "static", "storage": storage,
            "workers": 4, "threads": False, "path": "dataloader_workers",
        }  # fmt: skip
    rows["dl_fp8raw_static"] = {
        "feed": "hidden_state_loader", "mode": "static", "storage": "fp8_e4m3", "workers": 4,
        "threads": False, "path": "dataloader_workers_raw_fp8", "reader": {"raw_fp8": True},
        "gpu_dequantize": True,
    }  # fmt: skip
    rows["safetensors_bf16"] = {
        "feed": "safetensors", "mode": "static", "storage": "model", "workers": 4,
        "path": "dataloader_workers",
    }  # fmt: skip
    for name in list(rows):
        if not name.startswith("synthetic"):
            rows[f"{name}_alone"] = {**rows[name], "alone": True}
    return rows


# ----------------------------------------------------------------------------- running


def process_cpu_seconds() -> float:
    """CPU seconds of this process and its live children (DataLoader workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a worker that just ended
            total += sum(child.cpu_times()[:2])
    return total


def run_row(name: str, spec: dict[str, Any], data: dict[str, Path], trainer: Trainer | None,
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Warm up, then time ``args.seconds`` of steps (or of batches alone)."""
    root = data[spec["storage"]]
    producer = None
    if spec["mode"] == "follow":
        target = Path(tempfile.mkdtemp(prefix="follow-", dir=args.workdir))
        producer = Producer(root, target)
        producer.start()
        root = target
    batches = FEEDS[spec["feed"]](root, args, spec)
    alone = spec.get("alone", False)
    tokens = bytes_ = steps = 0
    waited = 0.0
    t0 = cpu0 = main0 = 0.0
    warm = args.warmup_steps
    while True:
        if steps == warm:
            torch.cuda.synchronize()
            t0, cpu0 = time.perf_counter(), process_cpu_seconds()
            main0 = time.thread_time()
            tokens = bytes_ = 0
            waited = 0.0
        # Every --sync-every steps the trainer waits for its step (to log the loss), as
        # trainers do; after that, time in next() is time the GPU sits idle.
        if args.sync_every and steps % args.sync_every == 0:
            torch.cuda.synchronize()
        w0 = time.perf_counter()
        batch = next(batches)
        if alone:  # the batch must really be there: wait for its copy
            torch.cuda.current_stream().synchronize()
        waited += time.perf_counter() - w0
        hidden = batch["hidden_states"][0]
        ids = batch["input_ids"][0]
        if trainer is not None and not alone:
            trainer.step(ids, hidden)
        tokens += hidden.shape[0]
        bytes_ += hidden.shape[0] * LAYERS * HIDDEN * 2  # bf16-equivalent bytes delivered
        steps += 1
        limit = args.alone_seconds if alone else args.seconds
        if steps > warm and time.perf_counter() - t0 >= limit:
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    cpu = process_cpu_seconds() - cpu0
    main_cpu = time.thread_time() - main0
    batches.close()
    if producer is not None:
        producer.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "kind": "train_feed",
        "row": name,
        "feed": spec["feed"],
        "path": spec.get("path", spec["feed"]),
        "mode": spec["mode"],
        "storage_dtype": spec["storage"],
        "workers": spec["workers"],
        "alone": alone,
        "steps": steps - warm,
        "seconds": round(elapsed, 2),
        "tok_s": round(tokens / elapsed),
        "data_wait_frac": round(waited / elapsed, 4),
        "main_thread_cpu_frac": round(main_cpu / elapsed, 3),
        "loader_gb_s": round(bytes_ / elapsed / 1e9, 2),
        "host_cpu_s_per_gb": round(cpu / (bytes_ / 1e9), 3) if bytes_ else None,
    }


def check_equal(data: dict[str, Path], batches: int = 3) -> dict[str, Any]:
    """The device feed's batches equal the plain loader's, bit for bit (bf16 and fp8)."""
    from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, PackCollate, PadCollate

    out: dict[str, Any] = {"kind": "train_feed_check"}
    for storage, root in data.items():
        for collate in (PackCollate(max_tokens=PACK_TOKENS), PadCollate()):

            def loader(root: Path = root, collate: Any = collate, **kw: Any) -> Iterator[Any]:
                ds = HiddenStateDataset(root, shuffle=True, seed=5)
                return iter(HiddenStateLoader(ds, BATCH_SAMPLES, collate_fn=collate, **kw))

            plain, fed = loader(num_workers=0), loader(num_workers=3, device="cuda")
            same = True
            for _ in range(batches):
                a, b = next(plain), next(fed)
                for key, value in a.items():
                    if isinstance(value, torch.Tensor):
                        same &= bool(torch.equal(value, b[key].cpu()))
                    else:
                        same &= value == b[key]
            out[f"{storage}_{type(collate).__name__}"] = same
    print("RESULT " + json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    global BATCH_SAMPLES  # --batch-samples: read by the feeds when they are made
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python benchmarks/gpu/train_feed.py --rows synthetic,hsl_bf16_static "
        "--seconds 10 --jsonl /tmp/out/results.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", default="all", help="comma-separated row names, or all")
    parser.add_argument("--seconds", type=float, default=15.0, help="timed seconds per row")
    parser.add_argument(
        "--batch-samples",
        type=int,
        default=BATCH_SAMPLES,
        help="samples per pack; 5 fills nearly every pack to 16,384 tokens (one shape)",
    )
    parser.add_argument("--alone-seconds", type=float, default=6.0, help="for *_alone rows")
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument(
        "--sync-every", type=int, default=1, help="wait for the GPU every N steps (0: never)"
    )
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (s)")
    parser.add_argument("--unique", type=int, default=48, help="distinct samples written")
    parser.add_argument("--copies", type=int, default=2, help="names per sample (hard links)")
    parser.add_argument("--workdir", default="/tmp", help="where the sample files go")
    parser.add_argument("--jsonl", help="append one JSON line per row here")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument(
        "--check", action="store_true", help="first check device-feed batches bit for bit"
    )
    args = parser.parse_args(argv)
    specs = row_specs()
    BATCH_SAMPLES = args.batch_samples
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.list:
        print("\n".join(specs))
        return 0
    names = list(specs) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in specs]
    if unknown:
        parser.error(f"unknown rows {unknown}; --list shows them")
    device = torch.device("cuda")
    work = Path(tempfile.mkdtemp(prefix="train-feed-", dir=args.workdir))
    data = {}
    for storage in sorted({specs[n]["storage"] for n in names if n != "synthetic"}):
        t = time.perf_counter()
        data[storage] = work / storage
        n = write_dataset(data[storage], args.unique, args.copies, storage != "model", device)
        print(f"wrote {storage}: {n} tokens in {time.perf_counter() - t:.1f} s", flush=True)
    if args.check:
        check = check_equal(data)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({**check, "date": args.date}) + "\n")
    trainer = Trainer(device) if any(not specs[n].get("alone") for n in names) else None
    synthetic_tok_s = varlen_tok_s = None
    for name in names:
        row = run_row(name, specs[name], data, trainer, args)
        if name == "synthetic":
            synthetic_tok_s = row["tok_s"]
        if name == "synthetic_varlen":
            varlen_tok_s = row["tok_s"]
        row.update(
            date=args.date,
            sync_every=args.sync_every,
            switch_interval=sys.getswitchinterval(),
            gpu=torch.cuda.get_device_name(),
            cpus=os.cpu_count(),
            tok_s_synthetic=synthetic_tok_s,
            ratio_vs_synthetic=(
                round(row["tok_s"] / synthetic_tok_s, 3)
                if synthetic_tok_s and not row["alone"]
                else None
            ),
            tok_s_synthetic_varlen=varlen_tok_s,
            ratio_vs_synthetic_varlen=(
                round(row["tok_s"] / varlen_tok_s, 3) if varlen_tok_s and not row["alone"] else None
            ),
        )
        line = json.dumps(row)
        print("RESULT " + line, flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(line + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
