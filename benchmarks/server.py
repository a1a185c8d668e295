"""Server overhead: vLLM (CPU build) prompt tokens/s with the connector vs baselines.

Configurations, each an offline ``vllm.LLM`` in its own subprocess (started once, then
driven round by round over a pipe, so rounds interleave as A B C D, B C D A, ...):

* ``none``: no hidden-state extraction at all.
* ``null``: ``extract_hidden_states`` + ``NullSinkConnector`` (benchmarks/null_sink.py),
  which frees blocks at once: extraction without copy-out or disk. The baseline.
* ``discard`` (full mode): ``HiddenStateConnector`` with a write path that drops the
  data: everything but the disk.
* ``ours``: ``HiddenStateConnector`` as shipped, default settings.

A round sends the same token-id prompts (``max_tokens=1``) to one engine and times
``generate()``; for the connectors it then waits until every sample's lock is released
(the file is published), so the end-to-end figure includes the disk path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.common import (
    IN_PROCESS_ENGINE,
    Context,
    bench_model,
    child_entry,
    child_env,
    fmt,
    goal,
    log,
    median,
    python_module,
    random_prompts,
    rotate,
    spread,
    table,
)

NAME = "server"
TITLE = "1. Server overhead (vLLM CPU, prompt tokens/s)"
MARK = "@@BENCH "
GOAL = 0.95

# vLLM's CPU build reserves one core for the engine-core process only when there is no
# kv_transfer_config; with one, on a 2-core machine, it reserves none and the engine
# core's busy-polling competes with the model's OpenMP threads (rounds then vary 5x).
# The same reservation for every configuration keeps them comparable.
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# The quick run (a smoke test of this benchmark, its numbers not reported) runs each engine
# in the calling process (common.IN_PROCESS_ENGINE): half its start-up.
QUICK_ENGINE_ENV = {**ENGINE_ENV, **IN_PROCESS_ENGINE}

MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "dtype": "bfloat16"}
LAYERS = [2, 4, 6, 8]


# ============================================================== engine subprocess side


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.batch_tokens,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 512 * 1024**2,  # CPU build: KV space in host memory
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "seed": 0,
    }
    if args.config == "none":
        return kw
    kw["speculative_config"] = speculative_config(args.layers)
    extra = {"shared_storage_path": args.out, "stats_interval": 0}
    if args.config == "null":
        kw["kv_transfer_config"] = {
            "kv_connector": "NullSinkConnector",
            "kv_connector_module_path": "benchmarks.null_sink",
            "kv_role": "kv_producer",
        }
    elif args.config == "discard":
        kw["kv_transfer_config"] = {
            "kv_connector": "DiscardConnector",
            "kv_connector_module_path": "benchmarks.null_sink",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        }
    elif args.config == "ours":
        kw["kv_transfer_config"] = kv_transfer_config(args.out, {"stats_interval": 0})
    elif args.config == "ours-nocheck":
        kw["kv_transfer_config"] = kv_transfer_config(
            args.out, {"stats_interval": 0, "check_nonfinite": False}
        )
    elif args.config == "ours-nocrc":
        kw["kv_transfer_config"] = kv_transfer_config(
            args.out, {"stats_interval": 0, "checksum": False}
        )
    elif args.config == "ours-fp8":
        kw["kv_transfer_config"] = kv_transfer_config(
            args.out, {"stats_interval": 0, "storage_dtype": "fp8_e4m3"}
        )
    else:
        raise ValueError(f"unknown configuration {args.config!r}")
    return kw


def _cpu_snapshot() -> dict[str, Any]:
    """CPU seconds of this process tree, by process role, plus per-thread for the worker."""
    import psutil

    me = psutil.Process()
    procs: dict[str, float] = {}
    threads: dict[int, dict[str, Any]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = proc.name()
            times = proc.cpu_times()
        except psutil.Error:
            continue
        role = "client" if proc.pid == me.pid else name.replace("VLLM::", "")
        procs[role] = procs.get(role, 0.0) + times.user + times.system
        if "Worker" in name:
            with contextlib.suppress(psutil.Error):
                for th in proc.threads():
                    try:
                        cpus = sorted(os.sched_getaffinity(th.id))
                    except OSError:
                        cpus = []
                    threads[th.id] = {
                        "cpu": th.user_time + th.system_time,
                        "affinity": cpus,
                        "main": th.id == proc.pid,
                    }
    return {"procs": procs, "threads": threads}


def _cpu_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    procs = {k: v - before["procs"].get(k, 0.0) for k, v in after["procs"].items()}
    rows = []
    for tid, info in after["threads"].items():
        prev = before["threads"].get(tid, {}).get("cpu", 0.0)
        rows.append(
            {
                "tid": int(tid),
                "cpu_s": info["cpu"] - prev,
                "affinity": ",".join(map(str, info["affinity"])),
                "main": info["main"],
            }
        )
    rows.sort(key=lambda r: -r["cpu_s"])
    busy = [r for r in rows if r["cpu_s"] >= 0.05]
    affinity: dict[str, int] = {}
    for r in rows:
        affinity[r["affinity"]] = affinity.get(r["affinity"], 0) + 1
    return {
        "procs": procs,
        "worker_threads": busy[:8],
        "worker_main_thread_s": sum(r["cpu_s"] for r in rows if r["main"]),
        "worker_other_threads_s": sum(r["cpu_s"] for r in rows if not r["main"]),
        "worker_threads_total": len(rows),
        "worker_thread_affinity": affinity,
    }


def _run_round(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from hidden_state_reader.files.locks import SharedLock

    prompts = random_prompts(cmd["seed"], cmd["count"], cmd["length"])
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    load = os.getloadavg()[0]
    cpu0 = _cpu_snapshot()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t1 = time.perf_counter()
    paths = []
    errors = []
    for out in outputs:
        params_out = getattr(out, "kv_transfer_params", None) or {}
        if "hidden_states_path" in params_out:
            paths.append(params_out["hidden_states_path"])
        if "hidden_states_error" in params_out:
            errors.append(params_out["hidden_states_error"])
    for path in paths:
        lock = SharedLock.acquire(path, timeout=600)
        if lock is not None:
            lock.release()
    t2 = time.perf_counter()
    cpu1 = _cpu_snapshot()
    written = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            written += os.path.getsize(path)
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".lock")
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "event": "round",
        "tokens": tokens,
        "requests": len(prompts),
        "generate_s": t1 - t0,
        "published_s": t2 - t0,
        "files": len(paths),
        "bytes_written": written,
        "errors": errors[:3],
        "loadavg": load,
        "cpu": _cpu_delta(cpu0, cpu1),
    }


def worker_main(argv: list[str]) -> None:
    """Entry point of one engine subprocess (``python -m benchmarks.server worker``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(args))
    _emit({"event": "ready", "startup_s": time.perf_counter() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            _emit(_run_round(llm, cmd))
        except Exception as exc:
            _emit({"event": "error", "error": repr(exc)})
    _emit({"event": "bye"})
    sys.stdout.flush()
    # vLLM's own shutdown of the engine processes takes seconds; the parent kills the
    # process group right after this line anyway.
    os._exit(0)


# ============================================================== orchestration side


class Engine:
    """One engine subprocess, driven over stdin/stdout."""

    def __init__(self, config: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.config = config
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env(**env),
            start_new_session=True,
        )
        self.events: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.events.put(json.loads(line[len(MARK) :]))
            else:
                self._log.write(line)
        self.events.put(None)

    def wait_event(self, timeout: float) -> dict[str, Any]:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.config}: no answer in {timeout:.0f}s") from None
        if event is None:
            raise RuntimeError(f"engine {self.config} exited:\n{self.tail()}")
        if event.get("event") == "error":
            raise RuntimeError(f"engine {self.config}: {event['error']}")
        return event

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def tail(self, n: int = 30) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send({"op": "quit"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        # The engine core and its worker live in this session's process group.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            time.sleep(0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


def _start_engines(
    engines: dict[str, Engine],
    configs: list[str],
    model_dir: Path,
    work: Path,
    batch_tokens: int,
    env: dict[str, str],
) -> None:
    """Start one worker process per configuration into ``engines`` (the caller stops them)."""
    for config in configs:
        cmd = python_module(
            "benchmarks.server",
            "worker",
            "--config",
            config,
            "--model",
            str(model_dir),
            "--out",
            str(work / f"hs-{config}"),
            "--dtype",
            MODEL["dtype"],
            "--layers",
            ",".join(map(str, LAYERS)),
            "--batch-tokens",
            str(batch_tokens),
        )
        engines[config] = Engine(config, cmd, work / f"engine-{config}.log", env)


def _measure(
    engines: dict[str, Engine], configs: list[str], rounds: int, count: int, length: int
) -> dict[str, list[dict[str, Any]]]:
    """Run every configuration once per round (rotating order); each round's result per config."""
    per: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in rotate(configs, r):
            engine = engines[config]
            engine.send({"op": "run", "seed": r, "count": count, "length": length})
            res = engine.wait_event(900)
            per[config].append(res)
            log(
                f"server: round {r + 1}/{rounds} {config:8s} "
                f"{res['tokens'] / res['generate_s']:8,.0f} tok/s generate, "
                f"{res['tokens'] / res['published_s']:8,.0f} tok/s until published"
            )
    return per


def run(ctx: Context) -> dict[str, Any]:
    work = ctx.workdir("server")
    configs = ctx.pick(
        ["null", "ours"],
        ["none", "null", "discard", "ours-nocheck", "ours-nocrc", "ours-fp8", "ours"],
    )
    rounds = ctx.pick(2, 7)
    count, length = ctx.pick((8, 256), (64, 512))
    batch_tokens = 2048
    model_dir = bench_model(ctx, MODEL)
    engine_env = ctx.pick(QUICK_ENGINE_ENV, ENGINE_ENV)
    engines: dict[str, Engine] = {}
    result: dict[str, Any] = {
        "model": {**MODEL, "layers_captured": LAYERS, "path": str(model_dir)},
        "setup": {
            "configs": configs,
            "rounds": rounds,
            "prompts_per_round": count,
            "prompt_tokens": length,
            "max_tokens": 1,
            "max_num_batched_tokens": batch_tokens,
            "kv_cache_memory_bytes": 512 * 1024**2,
            "enforce_eager": True,
            "engine_env": engine_env,
            "storage": str(work),
            "connector_settings": "defaults (8 writer threads, 2 GiB host buffers, "
            "16 MiB chunks, check_nonfinite on, CRC32 on, no fsync)",
        },
    }
    try:
        _start_engines(engines, configs, model_dir, work, batch_tokens, engine_env)
        log(f"server: starting {len(configs)} engines ({', '.join(configs)}) in parallel")
        startup = {}
        for config, engine in engines.items():
            startup[config] = engine.wait_event(900)["startup_s"]
            log(f"server: engine {config} ready ({startup[config]:.0f}s)")
        result["startup_s"] = startup
        # Warm-up: first requests pay for lazy allocations (slabs, caches, threads).
        for engine in [] if ctx.quick else list(engines.values()):
            engine.send({"op": "run", "seed": 999, "count": max(2, count // 4), "length": length})
            engine.wait_event(600)
        per = _measure(engines, configs, rounds, count, length)
    finally:
        for engine in engines.values():
            engine.stop()
    result["rounds"] = per
    result.update(_summarise(per, configs))
    return result


def _config_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rates, bytes, CPU per process and thread, errors and load."""
    gen = [r["tokens"] / r["generate_s"] for r in rounds]
    e2e = [r["tokens"] / r["published_s"] for r in rounds]
    cpu_procs: dict[str, list[float]] = {}
    for r in rounds:
        for role, secs in r["cpu"]["procs"].items():
            cpu_procs.setdefault(role, []).append(secs)
    return {
        "generate_tok_s": spread(gen),
        "published_tok_s": spread(e2e),
        "bytes_per_round": median([r["bytes_written"] for r in rounds]),
        "write_gb_s": median([r["bytes_written"] / r["published_s"] / 1e9 for r in rounds]),
        "cpu_s_per_round": {k: median(v) for k, v in cpu_procs.items()},
        "worker_main_thread_s": median([r["cpu"]["worker_main_thread_s"] for r in rounds]),
        "worker_other_threads_s": median([r["cpu"]["worker_other_threads_s"] for r in rounds]),
        "worker_threads_total": rounds[-1]["cpu"]["worker_threads_total"] if rounds else 0,
        "busiest_worker_threads": rounds[-1]["cpu"]["worker_threads"] if rounds else [],
        "errors": sorted({e for r in rounds for e in r["errors"]}),
        "loadavg": spread([r["loadavg"] for r in rounds]),
    }


def _paired(per: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> float:
    """Median over rounds of config ``a``'s tokens/s over ``b``'s (time from ``key``)."""
    if a not in per or b not in per:
        return float("nan")
    ratios = [
        (x["tokens"] / x[key]) / (y["tokens"] / y[key])
        for x, y in zip(per[a], per[b], strict=False)
    ]
    return median(ratios)


def _summarise(per: dict[str, list[dict[str, Any]]], configs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for config in configs:
        summary[config] = _config_summary(per[config])

    ratios = {}
    pairs = (
        ("ours", "null"),
        ("ours-nocheck", "null"),
        ("ours-nocrc", "null"),
        ("ours-fp8", "null"),
        ("discard", "null"),
        ("null", "none"),
        ("ours", "none"),
    )
    for a, b in pairs:
        if a in per and b in per:
            ratios[f"{a}/{b}"] = {
                "published": _paired(per, a, b, "published_s"),
                "generate": _paired(per, a, b, "generate_s"),
                "of_medians": summary[a]["published_tok_s"]["median"]
                / summary[b]["published_tok_s"]["median"],
                "per_round": [
                    (x["tokens"] / x["published_s"]) / (y["tokens"] / y["published_s"])
                    for x, y in zip(per[a], per[b], strict=False)
                ],
            }
    headline = ratios["ours/null"]["published"]
    return {
        "summary": summary,
        "ratios": ratios,
        "goals": [
            goal("server: ours / null sink, prompt tok/s until files are published", headline, GOAL)
        ],
    }


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    ratios = res["ratios"]
    on = ratios["ours/null"]
    verdict = "met" if on["published"] >= GOAL else "missed"
    text = (
        f"**Server overhead**: vLLM (CPU build) with the connector ran at "
        f"{on['published']:.3f}\u00d7 the prompt tokens/s of the same engine with a null sink, "
        f"counting until every file was published ({on['generate']:.3f}\u00d7 for "
        f"`generate()` alone): goal \u2265 {GOAL} {verdict}."
    )
    rounds = on.get("per_round") or []
    if rounds:
        text += (
            f" Per-round ratios ranged {min(rounds):.2f}\u2013{max(rounds):.2f} over "
            f"{len(rounds)} rounds."
        )
    if "ours-nocheck/null" in ratios:
        text += (
            " With `check_nonfinite` off (no NaN/inf check in the writer threads): "
            f"{ratios['ours-nocheck/null']['published']:.3f}\u00d7."
        )
    if "ours-nocrc/null" in ratios:
        text += (
            " With `checksum` off (no CRC32 in the writer threads): "
            f"{ratios['ours-nocrc/null']['published']:.3f}\u00d7."
        )
    if "ours-fp8/null" in ratios:
        text += (
            " With fp8 storage (`storage_dtype: fp8_e4m3`, half the bytes, quantized in the "
            f"writer threads): {ratios['ours-fp8/null']['published']:.3f}\u00d7."
        )
    if "discard/null" in ratios:
        text += (
            f" With the data gathered but not written: {ratios['discard/null']['published']:.3f}"
            "\u00d7."
        )
    if "null/none" in ratios:
        text += (
            f" Extraction itself (null sink vs no extraction): "
            f"{ratios['null/none']['published']:.3f}\u00d7."
        )
    return [text, *_cpu_finding(res)]


def _cpu_finding(res: dict[str, Any]) -> list[str]:
    """What the connector's threads cost in CPU time, and where they ran."""
    summary, out = res["summary"], []
    ours, null = summary.get("ours"), summary.get("null")
    # Only engines with a worker process of their own (the full run's layout; the quick
    # run's in-process engines have none to compare).
    if ours and null and "Worker" in ours["cpu_s_per_round"]:
        extra = ours["worker_other_threads_s"] - null["worker_other_threads_s"]
        worker = ours["cpu_s_per_round"]["Worker"]
        last = res["rounds"]["ours"][-1]["cpu"] if res["rounds"].get("ours") else {}
        affinity = last.get("worker_thread_affinity", {})
        pinned = ""
        if len(affinity) == 1:
            cpus, count = next(iter(affinity.items()))
            pinned = (
                f" All {count} threads of vLLM's worker process, the connector's writer threads "
                f"included, are pinned to CPU {cpus}, the core of the model's OpenMP main "
                "thread: vLLM binds that thread before the connector starts its threads, and "
                "new threads inherit the mask. The writers therefore take their CPU time from "
                "the model's core, while the reserved core runs only the engine core's "
                "busy-polling; on this 2-core machine that CPU time is what the connector "
                "costs the model."
            )
        out.append(
            f"The connector's threads used {extra:.2f} CPU-seconds per round more than the "
            f"null sink's ({extra / worker:.0%} of the worker process's "
            f"{worker:.2f} s).{pinned}"
        )
    return out


def _config_table(setup: dict[str, Any], summary: dict[str, Any]) -> str:
    """The main table: each configuration's tokens/s, write rate and CPU per round."""
    rows = []
    labels = {
        "none": "no extraction",
        "null": "extraction + null sink (baseline)",
        "discard": "ours, data discarded (no disk)",
        "ours-nocheck": "ours, check_nonfinite off",
        "ours-nocrc": "ours, checksum off",
        "ours-fp8": "ours, fp8 storage",
        "ours": "ours (HiddenStateConnector)",
    }
    for config in setup["configs"]:
        s = summary[config]
        g, p = s["generate_tok_s"], s["published_tok_s"]
        cpu = s["cpu_s_per_round"]
        rows.append(
            [
                labels.get(config, config),
                f"{fmt(g['median'])} ({fmt(g['min'])}\u2013{fmt(g['max'])})",
                f"{fmt(p['median'])} ({fmt(p['min'])}\u2013{fmt(p['max'])})",
                fmt(s["write_gb_s"] * 1000) + " MB/s" if s["bytes_per_round"] else "\u2013",
                f"{fmt(cpu.get('Worker', float('nan')))} / {fmt(s['worker_other_threads_s'])}",
                fmt(cpu.get("EngineCore", float("nan"))),
            ]
        )
    return table(
        [
            "configuration",
            "tok/s, generate()",
            "tok/s, until published",
            "written",
            "Worker CPU s/round (all / non-main threads)",
            "EngineCore CPU s/round",
        ],
        rows,
    )


def _threads_note(summary: dict[str, Any]) -> list[str]:
    """Lines on the busiest threads of the ``ours`` Worker process (none if not recorded)."""
    ours = summary.get("ours", {})
    threads = ours.get("busiest_worker_threads", [])
    if threads:
        desc = "; ".join(
            f"{'main' if t['main'] else 'tid ' + str(t['tid'])}: {t['cpu_s']:.2f} s "
            f"on CPUs {t['affinity']}"
            for t in threads[:6]
        )
        return [
            "",
            f"Busiest threads of the `ours` Worker process in its last round "
            f"({ours.get('worker_threads_total', 0)} threads): {desc}.",
        ]
    return []


def render(res: dict[str, Any]) -> str:
    setup = res["setup"]
    model = res["model"]
    out = [
        f"Tiny random Llama (hidden {model['hidden_size']}, {model['num_layers']} layers, "
        f"{model['dtype']}), layers {model['layers_captured']} captured "
        f"({len(model['layers_captured']) * model['hidden_size'] * 2:,} bytes of hidden states "
        f"per token). Each round: {setup['prompts_per_round']} token-id prompts \u00d7 "
        f"{setup['prompt_tokens']} tokens, `max_tokens=1`, "
        f"`max_num_batched_tokens={setup['max_num_batched_tokens']}`, eager, no prefix "
        f"caching; {setup['rounds']} rounds per configuration, interleaved (the order rotates "
        "every round); medians, with min\u2013max. One engine per configuration, each in its "
        "own process, all started before the first round. Connector: "
        f'{setup["connector_settings"]}. "until published" = `generate()` plus the wait '
        "until every sample's lock is released (the file is complete on disk). Every engine "
        "runs with `VLLM_CPU_NUM_OF_RESERVED_CPU=1`: vLLM's CPU build reserves a core for "
        "its engine-core process by itself only when there is no `kv_transfer_config`; "
        "without the same reservation for all, the configurations with a connector ran "
        "their OpenMP threads on both cores next to the engine core's busy-polling and "
        "rounds varied 5\u00d7.",
        "",
    ]
    summary = res["summary"]
    out.append(_config_table(setup, summary))
    out += ["", "Ratios (median of per-round ratios; each round pairs the configurations):", ""]
    out.append(
        table(
            ["ratio", "until published", "generate() only", "ratio of medians"],
            [[k, v["published"], v["generate"], v["of_medians"]] for k, v in res["ratios"].items()],
        )
    )
    startup = ", ".join(f"{k} {v:.0f} s" for k, v in res.get("startup_s", {}).items())
    out += ["", f"Engine start-up (parallel): {startup}."]
    out += _threads_note(summary)
    return "\n".join(out)


if __name__ == "__main__":
    child_entry(
        "worker", worker_main, "usage: python -m benchmarks.server worker --config ... (internal)"
    )
