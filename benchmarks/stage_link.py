"""Pipeline-parallel forward capture's channel alone: ``python benchmarks/stage_link.py``.

Two processes in a gloo group on this host (loopback TCP), as two pipeline stages on one
node: the first sends steps of rows with ``StageLink.send``, the last receives them with
``StageLink.receive``, as the send thread and the writer's ingest thread do. For each
step size, the time per step and the rows' bytes per second (median of ``--repeat``
rounds of ``--steps`` steps). Prints one JSON line per size; docs/benchmarks.md ("Issue
47") records the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import time
from typing import Any

import torch

from hidden_state_connector.engine.forward.stages import StageLink

# (tokens in the step, layers the first stage captures, hidden): a decode step of a tiny
# model, a chunked prefill of 512 tokens of an 8B-wide model, and one of 8,192.
SIZES = [(64, 3, 128), (512, 2, 4096), (8192, 2, 4096)]


def _stage(rank: int, port: int, args: Any, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    link = StageLink([0, 1], rank, timeout_s=120)
    for tokens, layers, hidden in SIZES:
        rows = torch.randn(tokens, layers, hidden).to(torch.bfloat16)  # token-major
        slots = torch.arange(tokens, dtype=torch.int64)
        rounds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for _ in range(args.steps):
                if rank == 0:
                    link.send(slots, rows)
                else:
                    link.receive(0, layers, hidden, torch.bfloat16)
            rounds.append((time.perf_counter() - start) / args.steps)
        if rank == 1:
            step = statistics.median(rounds)
            nbytes = rows.numel() * rows.element_size()
            queue.put(
                {
                    "tokens": tokens,
                    "layers": layers,
                    "hidden": hidden,
                    "bytes_per_step": nbytes,
                    "ms_per_step": round(step * 1e3, 3),
                    "gb_per_s": round(nbytes / step / 1e9, 3),
                }
            )
    link.close()
    dist.destroy_process_group()


def main() -> None:
    """Run both stages and print one JSON line per step size."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python benchmarks/stage_link.py --steps 20 --repeat 5",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for _ in SIZES:
        print(json.dumps(queue.get(timeout=600)))
    for p in procs:
        p.join(60)


if __name__ == "__main__":
    main()
