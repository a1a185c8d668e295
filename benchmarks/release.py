"""When is each sample's lock released, measured from the moment ``generate()`` returns?

An offline ``LLM`` (vLLM CPU) with the connector answers a batch of prompt-only requests
(``max_tokens=1``). The moment ``generate()`` returns, one thread per answered request
sleeps in ``flock(LOCK_SH)`` on its lock and takes ``CLOCK_MONOTONIC`` when the kernel
grants it: release delay = that time minus the return time (about 0 when the lock was already
free). No further request is sent. Engines run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it takes no engine step once its outputs are done)
and multiprocess, one engine at a time, for this checkout and for a baseline commit
(``RELEASE_BASELINE``, default: the last main before the connector published without a
further step). The connector's stage trace (``HIDDEN_STATE_CONNECTOR_TRACE``) says where
the time goes, where the checkout has it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Context,
    bench_model,
    child_entry,
    child_env,
    fmt,
    goal,
    log,
    percentile,
    table,
)

NAME = "release"
TITLE = "8. Lock release after generate() returns (offline engine, no further requests)"
BASELINE = os.environ.get("RELEASE_BASELINE", "4ba577d")
WAIT_S = 10.0  # a lock still held this long after the return counts as "not released"
MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "dtype": "bfloat16"}
LAYERS = [2, 4, 6, 8]
MODES = {"in-process": "0", "multiprocess": "1"}
GOAL_P99_MS = 100.0
MARK = "RESULT "


# ================================================================ engine subprocess side


def _wait_released(paths: list[str], returned: float) -> list[float | None]:
    """Milliseconds from ``returned`` until each lock is granted shared (None: not in time)."""
    granted: list[float | None] = [None] * len(paths)

    def wait(i: int) -> None:
        fd = os.open(paths[i] + ".lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # the kernel wakes us at the writer's release
        granted[i] = (time.monotonic() - returned) * 1e3
        os.close(fd)

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(paths))]
    for t in threads:
        t.start()
    deadline = returned + WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return granted


def _stages(trace: Path, returned: float, paths: set[str]) -> list[dict[str, float]]:
    if not trace.exists():
        return []
    rows = []
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("path") in paths and "copies_done" in rec:
            rows.append(
                {
                    "submitted_after_return_ms": (rec["submitted"] - returned) * 1e3,
                    "issue_ms": (rec["copies_issued"] - rec["submitted"]) * 1e3,
                    "copy_ms": (rec["copies_done"] - rec["copies_issued"]) * 1e3,
                    "write_publish_ms": (rec["released"] - rec["copies_done"]) * 1e3,
                    "released_after_return_ms": (rec["released"] - returned) * 1e3,
                }
            )
    return rows


def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.release child")
    for name in ("--mode", "--model", "--out", "--trace"):
        parser.add_argument(name, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = MODES[args.mode]
    os.environ["HIDDEN_STATE_CONNECTOR_TRACE"] = args.trace
    import torch
    from vllm import LLM, SamplingParams

    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    llm = LLM(
        model=args.model,
        dtype=MODEL["dtype"],
        max_model_len=1024,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=512 * 1024**2,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=speculative_config(LAYERS),
        kv_transfer_config=kv_transfer_config(args.out, {"stats_interval": 0}),
    )
    sampling = SamplingParams(max_tokens=1, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    rounds = []
    for r in range(args.rounds + 1):  # round 0 warms up (lazy allocations, threads)
        prompts = [
            {"prompt_token_ids": torch.randint(0, 250, (args.length,), generator=gen).tolist()}
            for _ in range(args.count)
        ]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        returned = time.monotonic()
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
        delays = _wait_released(paths, returned)
        if r == 0:
            continue
        stages = _stages(Path(args.trace), returned, set(paths))
        rounds.append({"delays_ms": delays, "stages": stages})
    print(MARK + json.dumps({"rounds": rounds}), flush=True)
    # Waiter threads still blocked on locks never released are daemons: they do not
    # hold the exit, and the engine's shutdown releases those locks.


# ======================================================================= parent side


def _baseline_sources(work: Path) -> Path | None:
    """The baseline commit's packages, unpacked (None if the commit is not in this clone)."""
    dest = work / f"baseline-{BASELINE}"
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", BASELINE, "packages"],
        capture_output=True,
    )
    if archive.returncode != 0:
        log(f"release: baseline {BASELINE} not found in this clone; measuring this checkout only")
        return None
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / "src.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _run_child(ctx: Context, work: Path, model: Path, mode: str, src: Path | None) -> dict:
    tag = f"{'baseline' if src else 'ours'}-{mode}"
    out, trace = work / f"hs-{tag}", work / f"trace-{tag}.jsonl"
    env = child_env()
    if src is not None:  # the baseline's packages shadow the installed (editable) ones
        paths = [str(src / "packages/connector/src"), str(src / "packages/reader/src")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env["PYTHONPATH"]])
    rounds, count = ctx.pick((1, 8), (4, 32))
    cmd = [sys.executable, "-m", "benchmarks.release", "child", "--mode", mode]
    cmd += ["--model", str(model), "--out", str(out), "--trace", str(trace)]
    cmd += ["--rounds", str(rounds), "--count", str(count)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln[len(MARK) :] for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"release child {tag} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _summary(raw: dict[str, Any]) -> dict[str, Any]:
    delays = [d for r in raw["rounds"] for d in r["delays_ms"]]
    released = [d for d in delays if d is not None]
    stages = [s for r in raw["rounds"] for s in r["stages"]]
    out: dict[str, Any] = {
        "samples": len(delays),
        "not_released": len(delays) - len(released),
        "p50_ms": percentile(released, 50),
        "p99_ms": percentile(released, 99),
        "max_ms": max(released) if released else None,
    }
    if stages:
        out["stages_p50_ms"] = {k: percentile([s[k] for s in stages], 50) for k in stages[0]}
    return out


def run(ctx: Context) -> dict[str, Any]:
    work = ctx.workdir("release")
    model = bench_model(ctx, MODEL)
    versions: dict[str, Path | None] = {"this checkout": None}
    if not ctx.quick and (src := _baseline_sources(work)) is not None:
        versions[f"baseline {BASELINE}"] = src
    modes = ctx.pick(["in-process"], list(MODES))
    results: dict[str, dict[str, Any]] = {}
    for version, src in versions.items():
        for mode in modes:
            log(f"release: {version}, {mode} engine")
            summary = _summary(_run_child(ctx, work, model, mode, src))
            results[f"{version} / {mode}"] = summary
            log(
                f"release: {version}, {mode}: p50 {fmt(summary['p50_ms'])} ms, p99 "
                f"{fmt(summary['p99_ms'])} ms, not released within {WAIT_S:.0f} s: "
                f"{summary['not_released']} of {summary['samples']}"
            )
    ours = results["this checkout / in-process"]
    worst = ours["p99_ms"] if ours["not_released"] == 0 else float("inf")
    return {
        "setup": {
            "model": MODEL,
            "layers": LAYERS,
            "prompts_per_round": ctx.pick(8, 32),
            "rounds": ctx.pick(1, 4),
            "prompt_tokens": 256,
            "wait_s": WAIT_S,
        },
        "results": results,
        "goals": [
            goal(
                "in-process lock release p99 after generate() returns",
                worst,
                GOAL_P99_MS,
                higher_is_better=False,
                unit="ms",
            )
        ],
    }


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    rows = [
        [
            name,
            r["samples"],
            r["not_released"],
            r["p50_ms"],
            r["p99_ms"],
            r["max_ms"],
        ]
        for name, r in res["results"].items()
    ]
    out = [
        f"{s['rounds']} rounds of {s['prompts_per_round']} prompts \u00d7 {s['prompt_tokens']} "
        f"tokens, `max_tokens=1`, tiny Llama (hidden {s['model']['hidden_size']}, "
        f"{s['model']['num_layers']} layers, bf16), layers {s['layers']}. Delay = the lock "
        "granted to a `flock(LOCK_SH)` waiter started when `generate()` returned \u2212 that "
        f"moment; no further request is sent; a lock still held after {s['wait_s']:.0f} s "
        "is counted as not released.",
        "",
        table(["version / engine", "samples", "not released", "p50 ms", "p99 ms", "max ms"], rows),
    ]
    staged = {k: r["stages_p50_ms"] for k, r in res["results"].items() if "stages_p50_ms" in r}
    if staged:
        keys = next(iter(staged.values())).keys()
        out += [
            "",
            "Where the time goes (median per sample, from the connector's stage trace; "
            "negative = before `generate()` returned):",
            "",
            table(["version / engine", *keys], [[k, *v.values()] for k, v in staged.items()]),
        ]
    return "\n".join(out)


if __name__ == "__main__":
    child_entry("child", child_main, "usage: python -m benchmarks.release child ... (internal)")
