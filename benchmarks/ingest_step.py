"""Forward capture's ingest of one step alone: ``python benchmarks/ingest_step.py``.

What the writer's ingest thread does with each step's host rows, at the 8B shape (4
captured layers of 4,096, bf16): route the rows to their requests (``RowRouter``), place
them in arena blocks and copy them there (``RowArena.write_step``). A decode step of 256
requests with 1, 4 (speculative decoding's drafts) or 32 rows each; rows in the batch in
request order, with CUDA-graph padding at the end; then the 4-row step with every 8th
request not captured (its rows are skipped: the gathered copy, not a view). Prints one
JSON line per step (median of ``--steps`` steps after two warm-up steps; ``copy_ms`` is
the copy alone, ``gb_per_s`` over route, place and copy). With ``--copy-threads``, the
same copies split over that many Python threads (one torch thread each): whether the
arena copy would gain from threads on this host. docs/benchmarks.md ("Issue 45")
records the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import torch

from hidden_state_connector.engine.forward.arena import RowArena
from hidden_state_connector.engine.forward.routing import RowRouter
from hidden_state_connector.engine.metadata import StepRows

LAYERS, HIDDEN, REQUESTS, PROMPT = 4, 4096, 256, 512
BLOCK = 16  # tokens per KV block (vLLM's default) and per arena block
TABLE = 128  # KV blocks per request's table


def one_size(rows_per_request: int, steps: int, skip_every: int = 0) -> dict[str, float | int]:
    """Time ``steps`` steps of ``REQUESTS`` requests with ``rows_per_request`` rows each.

    ``skip_every``: every such request is not captured (its rows match nothing).
    """
    per = rows_per_request
    n = REQUESTS * per
    rows = torch.randn(n, LAYERS, HIDDEN).to(torch.bfloat16)  # token-major, as the host copy
    entries, slots, step_rows = [], [], []
    for r in range(REQUESTS):
        if skip_every and r % skip_every == skip_every - 1:  # in the batch, not captured
            slots += [(REQUESTS + r) * TABLE * BLOCK + p for p in range(per)]
            continue
        first, last = PROMPT // BLOCK, (PROMPT + per - 1) // BLOCK
        blocks = [r * TABLE + b for b in range(first, last + 1)]
        step_rows.append(StepRows(f"r{r}", PROMPT, per, blocks, TABLE))
        entries.append((f"r{r}", PROMPT, PROMPT + per))
        slots += [(r * TABLE + p // BLOCK) * BLOCK + p % BLOCK for p in range(PROMPT, PROMPT + per)]
    slot_mapping = torch.tensor(slots + [-1] * BLOCK)  # padding rows match nothing
    arena = RowArena(
        REQUESTS * (TABLE * BLOCK) * LAYERS * HIDDEN * 2, BLOCK, LAYERS, HIDDEN, torch.bfloat16
    )
    router = RowRouter(BLOCK)
    for req_id, start, _ in entries:
        arena.reserve(req_id, 0, start)
    timings = []
    for index in range(steps + 2):
        t0 = time.perf_counter()
        route = router.route_flat(slot_mapping, step_rows)
        t1 = time.perf_counter()
        copies: list = []
        failures = arena.write_step(
            entries, route.rows, route.owner, route.positions, rows, None, copies
        )
        if failures:
            raise SystemExit(f"step not stored: {failures}")
        t2 = time.perf_counter()
        for copy in copies:
            copy()
        t3 = time.perf_counter()
        if index >= 2:  # the arena's pages are committed by then
            timings.append((t1 - t0, t2 - t1, t3 - t2))
    route_s, place_s, copy_s = (statistics.median(t[i] for t in timings) for i in range(3))
    nbytes = rows.numel() * rows.element_size()
    return {
        "rows_per_step": n,
        "rows_captured": sum(stop - start for _, start, stop in entries),
        "bytes_per_step": nbytes,
        "route_ms": round(route_s * 1e3, 3),
        "place_ms": round(place_s * 1e3, 3),
        "copy_ms": round(copy_s * 1e3, 3),
        "gb_per_s": round(nbytes / (route_s + place_s + copy_s) / 1e9, 3),
        "torch_threads": torch.get_num_threads(),
    }


def split_copy(rows_per_request: int, threads: int, steps: int) -> dict[str, float | int]:
    """The arena copy of one step's rows split over ``threads`` Python threads."""
    n = REQUESTS * rows_per_request
    rows = torch.randn(n, LAYERS, HIDDEN).to(torch.bfloat16)
    span = TABLE * BLOCK  # tokens of arena per request
    arena = torch.empty(REQUESTS * span, LAYERS, HIDDEN, dtype=torch.bfloat16)
    dest = torch.tensor(
        [r * span + PROMPT + t for r in range(REQUESTS) for t in range(rows_per_request)]
    )
    bounds = [n * i // threads for i in range(threads + 1)]
    parts = list(pairwise(bounds))

    def copy(part: tuple[int, int]) -> None:
        lo, hi = part
        arena.index_copy_(0, dest[lo:hi], rows[lo:hi])

    timings = []
    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        for index in range(steps + 2):
            t0 = time.perf_counter()
            list(pool.map(copy, parts))
            if index >= 2:
                timings.append(time.perf_counter() - t0)
    copy_s = statistics.median(timings)
    nbytes = rows.numel() * rows.element_size()
    return {
        "rows_per_step": n,
        "copy_threads": threads,
        "copy_ms": round(copy_s * 1e3, 3),
        "copy_gb_per_s": round(nbytes / copy_s / 1e9, 3),
    }


def main() -> None:
    """Print one JSON line per step size."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python benchmarks/ingest_step.py --threads 1 --copy-threads 1,2,4",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per size")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the ingest thread runs 1)"
    )
    parser.add_argument(
        "--copy-threads",
        default="",
        help="also time the arena copy split over these Python thread counts (e.g. 1,2,4)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for per in (1, 4, 32):
        print(json.dumps(one_size(per, args.steps)), flush=True)
    print(json.dumps({**one_size(4, args.steps, skip_every=8), "uncaptured": "every 8th"}))
    for threads in (int(t) for t in args.copy_threads.split(",") if t):
        for per in (4, 32):
            print(json.dumps(split_copy(per, threads, args.steps)), flush=True)


if __name__ == "__main__":
    main()
