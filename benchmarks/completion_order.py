"""Completion order: a live ``vllm serve`` with many concurrent, mixed requests.

The connector creates each request's lock when it is *scheduled*, so with many requests
in flight the samples complete in an order unrelated to the order their locks appeared:
a long prompt or a long generation (``include_output_tokens``) is still being written
while shorter requests scheduled after it are done. A follow reader must yield each
complete sample at once, not behind the slowest one in flight.

Measured: a real ``vllm serve`` (CPU build, the benchmarks' tiny Llama), first with one
client at a time (the sequential stream), then with ``CLIENTS`` concurrent clients of
mixed prompt lengths and output lengths, ``include_output_tokens`` on half of the
requests. A follow reader in its own process records, for every sample, when it was
yielded; the publication time is the data file's ``ctime`` (set by the kernel when the
connector renames the file into place). Latency = yield - publication, per sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    IN_PROCESS_ENGINE,
    Context,
    bench_model,
    child_env,
    goal,
    log,
    percentile,
    python_module,
    remove_tree_contents,
    table,
)
from hidden_state_connector.apps.server import free_port

NAME = "completion_order"
TITLE = "7. Completion order: concurrent clients of a live vLLM server"

CLIENTS = 16
PROMPT_TOKENS = (8, 48, 200, 700)
OUTPUT_TOKENS = (1, 4, 16, 48)
LAYERS = [1, 2, 3, 4]
MODEL = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "dtype": "bfloat16"}
GOAL_P50_MS, GOAL_P99_MS = 5.0, 50.0


# ================================================================ reader subprocess


def _record_event_arrivals() -> dict[tuple[str, str], int]:
    """Probe the reader's inotify events: when each event reached the reader process (ns).

    Keys: ``(sample name, "data")`` for the data file renamed into place, ``(sample name,
    "release")`` for the writer closing (releasing) its lock; the last of each.
    """
    from hidden_state_reader.files.inotify import IN_CLOSE_WRITE, IN_MOVED_TO
    from hidden_state_reader.format.names import LOCK_SUFFIX, sample_key
    from hidden_state_reader.probes import INOTIFY_EVENT, add_probe

    arrivals: dict[tuple[str, str], int] = {}

    def arrived(name: str, mask: int, time_ns: int) -> None:
        key = sample_key(name)
        if key is None:
            return
        if name.endswith(LOCK_SUFFIX) and mask & IN_CLOSE_WRITE:
            arrivals[(key, "release")] = time_ns
        elif not name.endswith(LOCK_SUFFIX) and mask & IN_MOVED_TO:
            arrivals[(key, "data")] = time_ns

    add_probe(INOTIFY_EVENT, arrived)  # for the life of this reader process
    return arrivals


def reader_main(argv: list[str]) -> None:
    """``python -m benchmarks.completion_order reader DIR COUNT``: follow, print JSON.

    The first sample (the driver's warm-up request) only proves the reader follows the
    directory; it prints ``ready`` then, and the next ``COUNT`` samples are measured.
    """
    from hidden_state_reader import HiddenStateReader

    directory, count = argv[0], int(argv[1])
    arrivals = _record_event_arrivals()
    rows = []
    reader = HiddenStateReader(directory, follow=True, idle_timeout=300, max_samples=count + 1)
    for i, sample in enumerate(reader):
        yielded = time.time_ns()
        if i == 0:
            print("ready", flush=True)
            continue
        name = os.path.basename(sample.path)
        published = os.stat(sample.path).st_ctime_ns
        data = arrivals.get((name, "data"), published)
        released = max(arrivals.get((name, "release"), data), data)
        rows.append(
            {
                "name": name,
                "latency_ms": (yielded - published) / 1e6,
                # publication -> its event reached the reader process's thread
                "to_event_ms": (data - published) / 1e6,
                # that event -> the writer's lock release reached it
                "to_release_ms": (released - data) / 1e6,
                # the release event -> yielded
                "reader_ms": (yielded - released) / 1e6,
                "tokens": sample.num_tokens,
            }
        )
    print(json.dumps({"samples": rows, "stats": reader.stats.as_dict()}), flush=True)


# ================================================================ driver side


def _requests(count: int, seed: int) -> list[dict[str, Any]]:
    """Mixed prompt and output lengths; ``include_output_tokens`` on every other one."""
    out = []
    for i in range(count):
        n = PROMPT_TOKENS[(i * 7 + seed) % len(PROMPT_TOKENS)]
        m = OUTPUT_TOKENS[(i * 3 + seed) % len(OUTPUT_TOKENS)]
        prompt = [(seed * 131 + i * 31 + k) % 250 + 3 for k in range(n)]
        params = {"include_output_tokens": True} if i % 2 else {}
        out.append({"prompt": prompt, "max_tokens": m, "params": params})
    return out


def _send(url: str, requests: list[dict[str, Any]], clients: int) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    from hidden_state_connector.client import complete

    def one(req: dict[str, Any]) -> str:
        result = complete(
            url,
            "tiny",
            req["prompt"],
            max_tokens=req["max_tokens"],
            kv_transfer_params=req["params"] or None,
        )
        params = result.get("kv_transfer_params") or {}
        return str(params.get("hidden_states_error") or "")

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return [e for e in pool.map(one, requests) if e]


def _phase(url: str, out_dir: Path, count: int, clients: int, seed: int) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_tree_contents(out_dir)  # the previous phase's samples
    reader = subprocess.Popen(
        python_module("benchmarks.completion_order", "reader", str(out_dir), str(count)),
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    assert reader.stdout is not None
    _send(url, _requests(1, seed + 100), 1)  # warm-up: the reader is following once it has it
    if reader.stdout.readline().strip() != "ready":
        reader.kill()
        raise RuntimeError("the reader process did not start")
    started = time.perf_counter()
    errors = _send(url, _requests(count, seed), clients)
    sent_s = time.perf_counter() - started
    out, _ = reader.communicate(timeout=600)
    if reader.returncode != 0:
        raise RuntimeError(f"reader exited {reader.returncode}")
    doc = json.loads(out.strip().splitlines()[-1])
    rows = doc["samples"]
    lat = [r["latency_ms"] for r in rows]
    parts = {key: [r[f"{key}_ms"] for r in rows] for key in ("to_event", "to_release", "reader")}
    return {
        "breakdown": {
            key: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "max_ms": max(v)}
            for key, v in parts.items()
            if v
        },
        "clients": clients,
        "requests": count,
        "samples": len(rows),
        "request_errors": errors[:5],
        "seconds": sent_s,
        "p50_ms": percentile(lat, 50),
        "p90_ms": percentile(lat, 90),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else float("nan"),
        "reader_stats": doc["stats"],
    }


def run(ctx: Context) -> dict[str, Any]:
    from hidden_state_connector.apps.server import ServeOptions, VllmServer

    work = ctx.workdir(NAME)
    sequential, concurrent = ctx.pick((8, 32), (48, 192))
    model_dir = bench_model(ctx, MODEL)
    options = ServeOptions(
        model=str(model_dir),
        out_dir=str(work / "hs"),
        layer_ids=LAYERS,
        port=free_port(),
        connector={"num_writer_threads": 4},
        vllm_args=[
            "--max-model-len", "2048",
            "--max-num-batched-tokens", "512",
            "--max-num-seqs", str(CLIENTS * 2),
            "--kv-cache-memory-bytes", str(512 * 1024**2),
            "--enforce-eager",
            "--served-model-name", "tiny",
        ],
    )  # fmt: skip
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    # The quick run (its numbers not reported) keeps the model in the engine core.
    env = ctx.pick({**env, **IN_PROCESS_ENGINE}, env)
    server = VllmServer(options, log_file=work / "server.log", env=env)
    log(f"{NAME}: starting vllm serve")
    with server:
        log(f"{NAME}: sequential, 1 client, {sequential} requests")
        seq = _phase(server.url, work / "hs", sequential, 1, seed=1)
        log(f"{NAME}: concurrent, {CLIENTS} clients, {concurrent} requests")
        conc = _phase(server.url, work / "hs", concurrent, CLIENTS, seed=2)
    for label, r in (("sequential", seq), ("concurrent", conc)):
        log(f"{NAME}: {label}: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")
    return {
        "setup": {
            "model": MODEL,
            "layers_captured": LAYERS,
            "prompt_tokens": list(PROMPT_TOKENS),
            "output_tokens": list(OUTPUT_TOKENS),
            "include_output_tokens": "every other request",
            "clients": CLIENTS,
        },
        "results": {"sequential (1 client)": seq, f"concurrent ({CLIENTS} clients)": conc},
        "goals": [
            _goal("p50", conc["p50_ms"], GOAL_P50_MS),
            _goal("p99", conc["p99_ms"], GOAL_P99_MS),
        ],
    }


def _goal(which: str, value: float, target: float) -> dict[str, Any]:
    metric = f"publication->yield {which}, {CLIENTS} clients"
    return goal(metric, value, target, higher_is_better=False, unit="ms")


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    results = list(res["results"].values())
    seq, conc = results[0], results[1]
    ok50 = "met" if conc["p50_ms"] <= GOAL_P50_MS else "missed"
    ok99 = "met" if conc["p99_ms"] <= GOAL_P99_MS else "missed"
    text = (
        f"**Completion order** (live vLLM, {conc['clients']} concurrent clients of mixed "
        f"lengths, publication \u2192 yield per sample): p50 {conc['p50_ms']:.2f} ms (goal "
        f"\u2264 {GOAL_P50_MS:g} ms {ok50}), p99 {conc['p99_ms']:.2f} ms (goal \u2264 "
        f"{GOAL_P99_MS:g} ms {ok99}), max {conc['max_ms']:.1f} ms over {conc['samples']} "
        f"samples; one client at a time: p50 {seq['p50_ms']:.2f} ms, p99 {seq['p99_ms']:.2f} ms."
    )
    bd = conc.get("breakdown")
    if bd:
        slow = max(bd, key=lambda k: bd[k]["p99_ms"])
        text += (
            f" The tail is in {_PARTS[slow]} (p99 {bd[slow]['p99_ms']:.1f} ms); the reader's own "
            f"part (release event \u2192 yield) is p50 {bd['reader']['p50_ms']:.2f} ms, p99 "
            f"{bd['reader']['p99_ms']:.1f} ms."
        )
    return [text]


_PARTS = {
    "to_event": "the kernel's rename event reaching the reader process (CPU scheduling: the "
    "2 cores are shared with the vLLM engine and the 16 client threads)",
    "to_release": "the writer's time between renaming the file and releasing its lock",
    "reader": "the reader itself",
}


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    rows = [
        [k, r["requests"], r["samples"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["max_ms"]]
        for k, r in res["results"].items()
    ]
    parts = [
        [k, _PART_NAMES[part], b["p50_ms"], b["p99_ms"], b["max_ms"]]
        for k, r in res["results"].items()
        for part, b in r.get("breakdown", {}).items()
    ]
    return "\n".join(
        [
            f"`vllm serve` (CPU) with a tiny Llama ({s['model']['num_layers']} layers, hidden "
            f"{s['model']['hidden_size']}), layers {s['layers_captured']} captured. Requests mix "
            f"prompt lengths {s['prompt_tokens']} and output lengths {s['output_tokens']} tokens, "
            f"`include_output_tokens` on {s['include_output_tokens']}. A follow reader in its "
            "own process; latency = the reader's yield time \u2212 the data file's ctime (set "
            "by the kernel when the connector renames the file into place; where the kernel "
            "stamps it from its coarse clock it can lag by up to one tick, which then counts "
            "in the first part below), for every sample. The sequential phase is the stream "
            "the `latency` benchmark measures; the concurrent one is where an earlier, "
            "longer request used to hold up every later one.",
            "",
            table(["phase", "requests", "samples", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows),
            "",
            "Where the time goes (event arrival times recorded in the reader process):",
            "",
            table(["phase", "part", "p50 ms", "p99 ms", "max ms"], parts),
        ]
    )


_PART_NAMES = {
    "to_event": "publication \u2192 rename event reaches the reader process",
    "to_release": "rename event \u2192 lock-release event (the writer)",
    "reader": "lock-release event \u2192 yield (the reader)",
}


if __name__ == "__main__":
    if sys.argv[1:2] == ["reader"]:
        reader_main(sys.argv[2:])
