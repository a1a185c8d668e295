"""Sustained production and consumption: one engine, N reader processes, one directory.

    python benchmarks/gpu/sustain.py --kind ours --target-gb 100 --readers 3
    python benchmarks/gpu/sustain.py --kind ours --connector '{"storage_dtype": "fp8_e4m3"}'
    python benchmarks/gpu/sustain.py --kind ours --connector '{"storage_dtype": "fp8_e4m3"}' \\
        --reader-device cuda
    python benchmarks/gpu/sustain.py --kind none --batches 4      # the no-extraction baseline

The engine (Llama-3.1-8B shape, dummy bf16 weights, ``bench.engine_kwargs``) generates
batches of ``--num-prompts`` x ``--prompt-len`` prompts (``max_tokens=1``) until the files
it produced reach ``--target-gb`` (or ``--batches`` batches). Meanwhile ``--readers``
processes follow the directory with the reader's default options plus ``follow=True,
claim=True, on_consumed="delete"`` (what a trainer fleet runs), move every sample's hidden
states to the GPU (``--reader-device cpu`` reads on the CPU and copies, ``cuda`` passes
``device="cuda"`` to the reader) and record when each sample was yielded. A thread counts
the files waiting in the directory (the backlog).

One JSON line per run (``kind: "sustain"``) goes to stdout after ``RESULT `` and is appended
to ``--jsonl``: tok/s per batch (median), produced / consumed samples and bytes, exactly
once checked across readers, the largest backlog, yield latency (file mtime -> yield)
p50 / p99, how long the readers needed after the last batch, and ``tok_s_none``: the
tok/s of the no-extraction run nearest in the file (filled in when that run is written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import engine_kwargs, log, make_8b_model, pct, random_prompts
from summary import pair_with_none

STOP_FILE = "STOP"  # written next to the output directory when the readers may stop


# --------------------------------------------------------------------------- readers


def reader_main(args: argparse.Namespace) -> int:
    """One reader process: follow, claim, delete; record (name, yield time, mtime, bytes)."""
    import torch

    from hidden_state_reader import HiddenStateReader

    kwargs: dict[str, Any] = {
        "follow": True,
        "claim": True,
        "on_consumed": "delete",
        "idle_timeout": None,
    }
    if args.reader_device != "cpu":
        kwargs["device"] = args.reader_device
    reader = HiddenStateReader(args.dir, **kwargs)
    stop = Path(args.dir).parent / STOP_FILE

    def stop_when_told() -> None:
        while not stop.exists():
            time.sleep(0.2)
        reader.close()

    threading.Thread(target=stop_when_told, daemon=True).start()
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    rows = []
    print("ready", flush=True)
    for sample in reader:
        try:
            st = os.stat(sample.path)
            mtime, size = st.st_mtime, st.st_size
        except FileNotFoundError:
            mtime, size = float("nan"), 0
        hs = sample.hidden_states
        if cuda is not None and hs.device.type != "cuda":
            hs = hs.to(cuda, non_blocking=False)
        if cuda is not None:
            torch.cuda.synchronize()
        delivered = hs.numel() * hs.element_size()
        rows.append((os.path.basename(sample.path), time.time(), mtime, size, delivered))
    Path(args.out).write_text(json.dumps({"rows": rows, "stats": str(reader.stats)}))
    return 0


def start_readers(args: argparse.Namespace, out_dir: str, work: Path) -> list[Any]:
    procs = []
    for i in range(args.readers):
        out = str(work / f"reader{i}.json")
        cmd = [sys.executable, __file__, "--role", "reader", "--dir", out_dir, "--out", out,
               "--reader-device", args.reader_device]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
    for proc in procs:  # each prints "ready" once its reader is built
        assert proc.stdout is not None
        proc.stdout.readline()
    return procs


# --------------------------------------------------------------------------- producer


class Backlog(threading.Thread):
    """Counts the sample files waiting in the directory every 0.25 s."""

    def __init__(self, directory: str) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.max_files = 0
        self.max_bytes = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.25):
            files = n_bytes = 0
            try:
                with os.scandir(self.directory) as it:
                    for entry in it:
                        if entry.name.endswith(".safetensors"):
                            files += 1
                            with contextlib.suppress(FileNotFoundError):
                                n_bytes += entry.stat().st_size
            except FileNotFoundError:
                return
            self.max_files = max(self.max_files, files)
            self.max_bytes = max(self.max_bytes, n_bytes)


def produce(args: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """Start the engine, generate batches until the target; per-batch tok/s and paths."""
    from vllm import LLM, SamplingParams

    kw = engine_kwargs(args, args.kind, out_dir)
    if args.cpu_smoke:  # vLLM's CPU build: no Triton attention, no GPU memory share
        kw.pop("attention_backend")
        kw.pop("gpu_memory_utilization")
    llm = LLM(**kw)
    vocab = args.vocab
    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    warm = random_prompts(8, args.prompt_len, vocab, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in warm], sampling, use_tqdm=False)
    tok_s: list[float] = []
    # The warm-up's samples are produced (and consumed) too; tok/s counts the batches only.
    paths = [str((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outs]
    paths = [p for p in paths if p]
    produced_bytes = 0
    started = time.monotonic()
    for batch in range(args.batches):
        prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, seed=100 + batch)
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        tok_s.append(args.num_prompts * args.prompt_len / (time.monotonic() - t0))
        new = [str((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outs]
        paths += [p for p in new if p]
        produced_bytes = args.sample_bytes * len(paths)
        log(f"batch {batch}: {tok_s[-1]:,.0f} tok/s, {produced_bytes / 1e9:.1f} GB so far")
        if args.target_gb and produced_bytes >= args.target_gb * 1e9:
            break
        free = shutil.disk_usage(out_dir).free
        if free < 12e9:  # readers fell behind: stop before the disk fills
            log(f"stopping: {free / 1e9:.1f} GB free")
            break
    return {"tok_s": tok_s, "paths": paths, "generate_s": time.monotonic() - started}


def sustain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="sustain-", dir=args.storage))
    out_dir = str(work / "hs")
    os.makedirs(out_dir)
    readers = start_readers(args, out_dir, work) if args.kind != "none" else []
    backlog = Backlog(out_dir)
    backlog.start()
    produced = produce(args, out_dir)
    gen_end = time.time()
    names = {os.path.basename(p) for p in produced["paths"]}
    # Let the readers drain what is left, then tell them to stop.
    deadline = time.monotonic() + args.drain_timeout
    while names and time.monotonic() < deadline:
        left = [n for n in os.listdir(out_dir) if n.endswith(".safetensors")]
        if not left:
            break
        time.sleep(0.2)
    drained_s = time.time() - gen_end
    (work / STOP_FILE).write_text("stop")
    for proc in readers:
        proc.wait(timeout=120)
    backlog.halt.set()
    got: list[tuple[Any, ...]] = []
    for i in range(len(readers)):
        got += [tuple(r) for r in json.loads((work / f"reader{i}.json").read_text())["rows"]]
    consumed = [r[0] for r in got]
    latency = [1000 * (r[1] - r[2]) for r in got if r[2] == r[2]]
    per_reader = [
        len(json.loads((work / f"reader{i}.json").read_text())["rows"]) for i in range(len(readers))
    ]
    conn = json.loads(args.connector)
    from hidden_state_reader.kernels.fp8_cpu import kernel  # the readers' install too

    row = {
        "date": time.strftime("%Y-%m-%d"),
        "kind": "sustain",
        "producer": args.kind,
        "storage_dtype": conn.get("storage_dtype", "model"),
        "reader_device": args.reader_device,
        "fp8_cpu_kernel": kernel(),
        "readers": args.readers,
        "graphs": args.graphs,
        "prompts_per_batch": args.num_prompts,
        "prompt_len": args.prompt_len,
        "batches": len(produced["tok_s"]),
        "tok_s": statistics.median(produced["tok_s"]),
        "tok_s_batches": produced["tok_s"],
        "produced": len(names),
        "consumed": len(consumed),
        "consumed_unique": len(set(consumed)),
        "exactly_once": sorted(consumed) == sorted(names),
        "per_reader": per_reader,
        "produced_bytes": sum(r[3] for r in got),
        "delivered_bytes": sum(r[4] for r in got),
        "file_bytes_max_backlog": backlog.max_bytes,
        "max_backlog_files": backlog.max_files,
        "yield_latency_p50_ms": pct(latency, 0.5),
        "yield_latency_p99_ms": pct(latency, 0.99),
        "drained_after_generate_s": drained_s,
        "generate_s": produced["generate_s"],
    }
    shutil.rmtree(work, ignore_errors=True)
    return row


def build_parser() -> argparse.ArgumentParser:
    """The command line (an argparse table)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--role", choices=["producer", "reader"], default="producer")
    p.add_argument("--kind", default="ours", help="ours | none")
    p.add_argument("--connector", default="{}", help="extra connector config JSON")
    p.add_argument("--readers", type=int, default=3)
    p.add_argument("--reader-device", default="cpu", help="cpu | cuda (the reader's device=)")
    p.add_argument("--target-gb", type=float, default=0.0)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--storage", default="/tmp")
    p.add_argument("--drain-timeout", type=float, default=240.0)
    p.add_argument("--jsonl", default="")
    p.add_argument("--work", default="/tmp/hs-bench")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on vLLM CPU: checks the script only")  # fmt: skip
    # reader role
    p.add_argument("--dir", default="")
    p.add_argument("--out", default="")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.role == "reader":
        return reader_main(args)
    os.makedirs(args.work, exist_ok=True)
    args.dtype = "bfloat16"
    args.max_model_len = args.prompt_len + 64
    args.max_num_batched_tokens = 0
    args.gpu_mem = 0.80
    args.tp = 1
    if args.cpu_smoke:
        from hidden_state_connector.apps.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path(args.work) / "tiny"))
        args.dummy, args.layers, hidden, args.vocab = False, [1, 2, 4], 128, 256
    else:
        args.model = str(make_8b_model(Path(args.work)))
        args.dummy, args.layers, hidden, args.vocab = True, [2, 16, 29, 32], 4096, 128256
    # bf16 bytes of one sample's hidden states (what a trainer gets after dequantizing)
    args.sample_bytes = args.prompt_len * len(args.layers) * hidden * 2
    if args.target_gb:
        args.batches = 10_000
    row = sustain(args)
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    if args.jsonl:
        # Append, then give every run in the file its no-extraction figure (tok_s_none)
        # from the nearest no-extraction run: one that ran later fills earlier rows.
        path = Path(args.jsonl)
        lines = path.read_text().splitlines() if path.exists() else []
        rows = [json.loads(text) for text in lines if text.strip()] + [row]
        path.write_text("".join(json.dumps(r) + "\n" for r in pair_with_none(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
