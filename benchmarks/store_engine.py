"""Section 10's vLLM part: prompt tokens/s of an engine writing to the store vs files.

Run by ``benchmarks.store`` in full mode, inside its loopback-only namespace (the store's
master and segment host are up). Two offline ``vllm.LLM`` engines (vLLM CPU, in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one per ``storage_backend``, each in its own
subprocess, started once and driven round by round over a pipe: files, store, files,
store, ... A round sends the same token-id prompts (``max_tokens=1``) to one engine,
times ``generate()``, then waits until every sample is published, as a consumer sees
it: files, the sample's lock granted shared (like ``benchmarks/server.py``); store, its
commit record read from the producers' commit logs (``store.follow.CommitLog``, what a
store reader discovers samples by). Where the time goes comes from the connector's stage
trace (``HIDDEN_STATE_CONNECTOR_TRACE``) plus the time of each put (the store lock's
release, timed in the engine process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.common import REPO, child_entry, child_env, log, median, random_prompts, spread

MARK = "@@STORE-ENGINE "
MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "dtype": "bfloat16"}
LAYERS = [2, 4, 6, 8]  # as benchmarks/server.py: 4,096 bytes of hidden states per token
BACKENDS = ("files", "store")
PREFIX = "bench-vllm"
ENGINE = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 2048,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 1024**2,
    "skip_tokenizer_init": True,
    "enable_prefix_caching": False,
    "seed": 0,
}


# ============================================================== engine subprocess side


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _connector(backend: str, out: str, master: str) -> dict[str, Any]:
    from hidden_state_connector.apps.server import kv_transfer_config

    extra: dict[str, Any] = {"stats_interval": 0}
    if backend == "store":
        extra |= {
            "storage_backend": "mooncake",
            "mooncake_master": master,
            "mooncake_prefix": PREFIX,
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_buffer_bytes": "64MiB",
        }
    return kv_transfer_config(out, extra)


def _time_puts(puts: dict[str, tuple[float, float]]) -> None:
    """Record (start, end) of every put by staged path (the trace's ``path``)."""
    from hidden_state_reader.probes import STORE_PUT, add_probe

    def put(staged: str, began: float, ended: float) -> None:
        puts[staged] = (began, ended)

    add_probe(STORE_PUT, put)  # for the life of this benchmark process


class _Published:
    """Waits until a round's samples are readable, as a consumer of the backend sees it."""

    def __init__(self, backend: str, master: str) -> None:
        self.backend = backend
        self.commits: Any = None
        self.seen: set[str] = set()
        if backend == "store":
            from hidden_state_reader.store.client import StoreClient
            from hidden_state_reader.store.follow import CommitLog
            from hidden_state_reader.store.url import parse_store_url

            url = f"mooncake://{master}/{PREFIX}?hostname=127.0.0.1&buffer=16MiB"
            self.commits = CommitLog(StoreClient(parse_store_url(url)), hole_grace=60)

    def wait(self, params: list[dict[str, Any]], timeout: float = 600) -> int:
        """Block until every sample is published; the number that failed instead."""
        if self.backend == "files":
            from hidden_state_reader.files.locks import SharedLock

            for p in params:
                lock = SharedLock.acquire(p["hidden_states_path"], timeout=timeout)
                if lock is not None:
                    lock.release()
            return 0
        pending, failed = {p["hidden_states_key"] for p in params}, 0
        deadline = time.monotonic() + timeout
        while pending - self.seen:
            for _, record in self.commits.poll():
                self.seen.add(record.name)
                failed += int(record.name in pending and not record.ok)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending - self.seen)} samples never committed")
            time.sleep(0.0005)  # the poll itself is a round trip to the master
        return failed


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of the whole machine (busy, all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return time.process_time(), (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _stages(trace: Path, since: float, puts: dict[str, tuple[float, float]]) -> list[dict]:
    """Per sample of the round (submitted after ``since``), its stage durations in ms."""
    rows = []
    for line in trace.read_text().splitlines() if trace.exists() else []:
        rec = json.loads(line)
        if rec.get("submitted", 0) < since or "copies_done" not in rec:
            continue
        start, end = puts.get(rec["path"], (rec["released"], rec["released"]))
        rows.append(
            {
                "gather_copy_ms": (rec["copies_done"] - rec["submitted"]) * 1e3,
                "finish_ms": (start - rec["copies_done"]) * 1e3,
                "put_ms": (end - start) * 1e3,
                "after_put_ms": (rec["released"] - end) * 1e3,
            }
        )
    return rows


def _round(llm: Any, waiter: _Published, cmd: dict[str, Any], ctx: dict[str, Any]) -> dict:
    from vllm import SamplingParams

    prompts = random_prompts(cmd["seed"], cmd["count"], cmd["length"])
    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    since = time.monotonic()
    own0, busy0 = _cpu()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    t1 = time.perf_counter()
    params = [dict(o.kv_transfer_params or {}) for o in outputs]
    errors = [p["hidden_states_error"] for p in params if "hidden_states_error" in p]
    failed = waiter.wait([p for p in params if "hidden_states_error" not in p])
    t2 = time.perf_counter()
    own1, busy1 = _cpu()
    nbytes = 0
    for p in params if waiter.backend == "files" else []:  # consumed: keep the dir small
        with contextlib.suppress(FileNotFoundError):
            nbytes += os.path.getsize(p["hidden_states_path"])
            os.unlink(p["hidden_states_path"])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p["hidden_states_path"] + ".lock")
    return {
        "event": "round",
        "tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "requests": len(prompts),
        "generate_s": t1 - t0,
        "published_s": t2 - t0,
        "errors": errors[:3] + ([f"{failed} failed"] if failed else []),
        "bytes": nbytes,
        "stages": _stages(ctx["trace"], since, ctx["puts"]),
        "loadavg": os.getloadavg()[0],
        "engine_cpu_s": own1 - own0,
        # The rest of the machine's CPU over the round, as a share of all its cores.
        "others_cpu_share": ((busy1 - busy0) - (own1 - own0)) / ((t2 - t0) * (os.cpu_count() or 1)),
    }


def worker_main(argv: list[str]) -> None:
    """One engine (``python -m benchmarks.store_engine worker ...``), driven over stdin."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_engine worker")
    for name in ("--backend", "--model", "--out", "--master", "--trace"):
        parser.add_argument(name, required=True)
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector runs in this process
    os.environ["HIDDEN_STATE_CONNECTOR_TRACE"] = args.trace
    puts: dict[str, tuple[float, float]] = {}
    _time_puts(puts)
    from vllm import LLM

    from hidden_state_connector.apps.server import speculative_config

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=MODEL["dtype"],
        **ENGINE,
        speculative_config=speculative_config(LAYERS),
        kv_transfer_config=_connector(args.backend, args.out, args.master),
    )
    waiter = _Published(args.backend, args.master)
    _emit({"event": "ready", "startup_s": time.perf_counter() - t0})
    ctx = {"trace": Path(args.trace), "puts": puts}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            _emit(_round(llm, waiter, cmd, ctx))
        except Exception as exc:
            _emit({"event": "error", "error": repr(exc)})
    _emit({"event": "bye"})
    sys.stdout.flush()
    os._exit(0)  # the engine's teardown adds nothing to measure (and can hang)


# ======================================================================= parent side


class _Engine:
    """One engine subprocess, driven over stdin/stdout."""

    def __init__(self, backend: str, argv: list[str], log_path: Path) -> None:
        self.backend = backend
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
            env=child_env(),
        )
        self.events: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.events.put(json.loads(line[len(MARK) :]))
        self.events.put(None)

    def ask(self, cmd: dict[str, Any] | None, timeout: float = 600) -> dict[str, Any]:
        """Send ``cmd`` (None: nothing) and wait for the engine's next event."""
        if cmd is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.backend} engine: no answer in {timeout:.0f} s") from None
        if event is None or event.get("event") == "error":
            self._log.flush()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.backend} engine failed: {event}\n{tail}")
        return event

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.ask({"op": "quit"}, timeout=30)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _engine(backend: str, model: Path, work: Path, master: str) -> _Engine:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.store_engine",
        "worker",
        "--backend",
        backend,
        "--model",
        str(model),
        "--out",
        str(work / f"hs-{backend}"),
        "--master",
        master,
        "--trace",
        str(work / f"trace-{backend}.jsonl"),
    ]
    return _Engine(backend, argv, work / f"engine-{backend}.log")


def measure(model: Path, work: Path, master: str, rounds: int, count: int, length: int) -> dict:
    """Both engines, ``rounds`` interleaved rounds each after one warm-up; the summary."""
    engines: dict[str, _Engine] = {}
    per: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
    startup: dict[str, float] = {}
    try:
        for backend in BACKENDS:  # one at a time: two start-ups would share 2 cores
            engines[backend] = _engine(backend, model, work, master)
            startup[backend] = engines[backend].ask(None, timeout=900)["startup_s"]
            log(f"store: {backend} engine ready ({startup[backend]:.0f} s)")
        for engine in engines.values():  # first requests pay lazy allocations
            engine.ask({"op": "run", "seed": 999, "count": count, "length": length})
        for r in range(rounds):
            for backend in BACKENDS:
                res = engines[backend].ask(
                    {"op": "run", "seed": r, "count": count, "length": length}
                )
                per[backend].append(res)
                log(
                    f"store: round {r + 1}/{rounds} {backend:5s} "
                    f"{res['tokens'] / res['published_s']:7,.0f} tok/s until published"
                )
    finally:
        for engine in engines.values():
            engine.stop()
    return summarise(
        per, startup, {"rounds": rounds, "prompts_per_round": count, "prompt_tokens": length}
    )


def summarise(per: dict[str, list[dict]], startup: dict[str, float], setup: dict) -> dict:
    """Rates per backend, the paired store/files ratio per round, stage medians."""
    out: dict[str, Any] = {
        "setup": {**setup, "model": MODEL, "layers": LAYERS, "engine": ENGINE},
        "startup_s": startup,
    }
    for backend, rounds in per.items():
        stages = [s for r in rounds for s in r["stages"]]
        out[backend] = {
            "published_tok_s": spread([r["tokens"] / r["published_s"] for r in rounds]),
            "generate_tok_s": spread([r["tokens"] / r["generate_s"] for r in rounds]),
            "tail_ms": median([(r["published_s"] - r["generate_s"]) * 1e3 for r in rounds]),
            "stages_p50_ms": {k: median([s[k] for s in stages]) for k in stages[0]}
            if stages
            else {},
            "errors": sorted({e for r in rounds for e in r["errors"]}),
            "samples": sum(r["requests"] for r in rounds),
            "rounds_published_tok_s": [r["tokens"] / r["published_s"] for r in rounds],
            "engine_cpu_s": median([r["engine_cpu_s"] for r in rounds]),
            "others_cpu_share": median([r["others_cpu_share"] for r in rounds]),
        }

    def paired(key: str) -> float:
        return median([f[key] / s[key] for f, s in zip(per["files"], per["store"], strict=True)])

    # Same tokens in both rounds of a pair: the ratio of rates is the ratio of times.
    out["ratio"] = {"published": paired("published_s"), "generate": paired("generate_s")}
    return out


# ========================================================================= rendering

_LABELS = {
    "files": 'files (`storage_backend="files"`)',
    "store": 'Mooncake Store (`storage_backend="mooncake"`)',
}
_STAGES = {
    "gather_copy_ms": "gather + copy (+ streamed writes)",
    "finish_ms": "finish file",
    "put_ms": "put + commit",
    "after_put_ms": "after",
}


def _rate(s: dict[str, float]) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}\u2013{s['max']:,.0f})"


def render_engines(res: dict[str, Any]) -> str:
    """The vLLM part of section 10: rates, the paired ratio, where a sample's time goes."""
    from benchmarks.common import table

    s, r = res["setup"], res["ratio"]
    rates = [
        [_LABELS[b], _rate(res[b]["published_tok_s"]), _rate(res[b]["generate_tok_s"]),
         res[b]["tail_ms"], res[b]["engine_cpu_s"], f"{res[b]['others_cpu_share']:.0%}"]
        for b in BACKENDS
    ]  # fmt: skip
    stages = [[_LABELS[b], *(res[b]["stages_p50_ms"].get(k, 0.0) for k in _STAGES)]
              for b in BACKENDS]  # fmt: skip
    head = ["backend", "tok/s until published", "tok/s generate()", "tail after generate() ms",
            "engine CPU s/round", "rest of the machine's CPU"]  # fmt: skip
    return "\n".join([
        f"**vLLM server with the store backend.** One in-process vLLM CPU engine per backend "
        f"(tiny Llama, hidden {s['model']['hidden_size']}, {s['model']['num_layers']} layers, "
        f"bf16, layers {s['layers']}: 4,096 bytes per token), both in the namespace; "
        f"{s['rounds']} rounds each after a warm-up, interleaved (files, store, files, ...), "
        f"{s['prompts_per_round']} prompts \u00d7 {s['prompt_tokens']} tokens, `max_tokens=1`. "
        '"Until published" = `generate()` plus the wait until a consumer can read every '
        "sample: files, its lock granted shared; store, its commit record found in the "
        "commit log. Rates: median (min\u2013max) over rounds; the tail and CPU columns: "
        "medians over rounds.",
        "",
        table(head, rates),
        "",
        f"Ratio store / files (median of per-round pairs): {r['published']:.3f}\u00d7 until "
        f"published, {r['generate']:.3f}\u00d7 for `generate()` alone.",
        "",
        "Where a sample's time goes (median per sample, from the connector's stage trace and "
        "the timed put; the writer threads overlap these with the engine's steps):",
        "",
        table(["backend", *(f"{v} ms" for v in _STAGES.values())], stages),
    ])  # fmt: skip


def engine_finding(res: dict[str, Any]) -> str:
    """One sentence for the findings list."""
    f, st = res["files"], res["store"]
    return (
        f"a vLLM CPU engine writing to the store runs at {res['ratio']['published']:.3f}\u00d7 "
        f"the prompt tokens/s of the same engine writing files, until published "
        f"({st['published_tok_s']['median']:,.0f} vs {f['published_tok_s']['median']:,.0f} "
        f"tok/s; {res['ratio']['generate']:.3f}\u00d7 for generate() alone); the store's "
        f"write path ends {st['tail_ms']:.1f} ms after generate() returns (files "
        f"{f['tail_ms']:.1f} ms), its put + commit taking "
        f"{st['stages_p50_ms'].get('put_ms', float('nan')):.1f} ms per sample"
    )


if __name__ == "__main__":
    child_entry("worker", worker_main, "usage: python -m benchmarks.store_engine worker ...")
