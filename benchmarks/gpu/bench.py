"""GPU validation and side-by-side measurements of the connector (run on a CUDA machine).

Every engine configuration runs in its own subprocess (a clean GPU), driven by ``main``:

    python benchmarks/gpu/bench.py validate             # values vs HF on CUDA, fp32 + bf16
    python benchmarks/gpu/bench.py throughput           # none / vLLM example / ours, disk + shm
    python benchmarks/gpu/bench.py long                 # 32k-token requests: extra device memory
    python benchmarks/gpu/bench.py throughput --workloads chat512 --kinds none,forward
    python benchmarks/gpu/bench.py reader               # follow+claim readers at producer speed
    python benchmarks/gpu/bench.py tp2                  # tensor parallel 2 (two GPUs)

Results are printed as a table and written as JSON (``--json``). ``benchmarks/gpu/run.sh``
installs the vLLM 0.26 kit and runs a chosen set in one device call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAYERS_8B = [2, 16, 29, 32]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- engines


def make_8b_model(root: Path) -> Path:
    path = root / "llama-8b-shape"
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "llama8b_config.json", path / "config.json")
    return path


def engine_kwargs(args: argparse.Namespace, kind: str, out: str) -> dict[str, Any]:
    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enforce_eager": not args.graphs,
        "attention_backend": "TRITON_ATTN",
        "gpu_memory_utilization": args.gpu_mem,
        "skip_tokenizer_init": True,
        "seed": 0,
        "enable_prefix_caching": False,
        "tensor_parallel_size": args.tp,
    }
    if args.dummy:
        kw["load_format"] = "dummy"
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.spec:  # a drafter beside the target: none (spec alone) or forward capture
        if kind not in ("none", "forward"):
            raise SystemExit(f"--spec runs with kinds none and forward, not {kind}")
        kw.update(speculative_config=SPEC_CONFIGS[args.spec], async_scheduling=False)
        kw["disable_log_stats"] = False  # vLLM's drafted/accepted counters
    if kind == "none":
        return kw
    if kind == "noop":  # a KV connector that does nothing: vLLM's connector hooks alone
        kw["kv_transfer_config"] = {
            "kv_connector": "NullSinkConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "benchmarks.null_sink",
        }
        return kw
    if kind in ("forward", "forward-discard"):  # capture from the forward pass
        extra = {"stats_interval": 0, **json.loads(args.connector)}
        extra.update(capture="forward", layer_ids=args.layers)
        kw["kv_transfer_config"] = kv_transfer_config(out, extra)
        if kind == "forward-discard":  # every stage but the file: chunks dropped
            kw["kv_transfer_config"].update(
                kv_connector="DiscardConnector", kv_connector_module_path="benchmarks.null_sink"
            )
        return kw
    kw["speculative_config"] = speculative_config(args.layers)
    if kind == "ours":
        extra = {"stats_interval": 0, **json.loads(args.connector)}
        kw["kv_transfer_config"] = {
            **kv_transfer_config(out, extra),
            "kv_connector_module_path": "hidden_state_connector.connector",
        }
    elif kind == "example":
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": out},
        }
    elif kind == "null":  # extraction, blocks freed at once, nothing copied or written
        kw["kv_transfer_config"] = {
            "kv_connector": "NullSinkConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "benchmarks.null_sink",
        }
    elif kind != "extract-only":
        raise SystemExit(f"unknown kind {kind}")
    return kw


SPEC_CONFIGS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
}
"""``--spec``: vLLM's ``speculative_config`` of each drafter the throughput rows can run."""


def random_prompts(
    n: int, length: int, vocab: int, seed: int, repetitive: bool = False
) -> list[list[int]]:
    """Random token ids; ``repetitive``: each prompt a random 16-token motif repeated."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if not repetitive:
        return torch.randint(10, vocab - 10, (n, length), generator=gen).tolist()
    motifs = torch.randint(10, vocab - 10, (n, 16), generator=gen)
    return motifs.repeat(1, length // 16 + 1)[:, :length].tolist()


def chat_mix(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``n`` chat-like requests: prompts of 200-4,000 tokens, replies of 100-1,000 (uniform)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 4001, (n,), generator=gen).tolist()
    replies = torch.randint(100, 1001, (n,), generator=gen).tolist()
    prompts = [torch.randint(10, vocab - 10, (k,), generator=gen).tolist() for k in lengths]
    return prompts, replies


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's drafted/accepted token counters so far (empty without speculation)."""
    found: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # an engine without stats
        return found
    for metric in metrics:
        if metric.name in (
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
        ):
            found[metric.name.rsplit("_num_", 1)[1]] = float(getattr(metric, "value", 0.0))
    return found


def wait_released(paths: list[str], t0: float) -> list[float]:
    """Seconds after t0 at which each file's lock could be taken (in file order)."""
    from hidden_state_reader.files.locks import SharedLock

    out = []
    for p in paths:
        lock = SharedLock.acquire(p, timeout=600)
        out.append(time.monotonic() - t0)
        if lock is not None:
            lock.release()
    return out


def stage_summary(trace: Path, paths: set[str], returned: float) -> dict[str, float]:
    """p50 / p99 of each write stage, and of the release relative to generate()'s return."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    rows = [r for r in rows if r.get("path") in paths and "copies_done" in r]
    spans = {
        "issue": ("submitted", "copies_issued"),
        "copy": ("copies_issued", "copies_done"),
        "write_publish": ("copies_done", "released"),
    }
    out: dict[str, float] = {"samples": len(rows)}
    for name, (a, b) in spans.items():
        values = [1000 * (r[b] - r[a]) for r in rows]
        out[f"{name}_p50"], out[f"{name}_p99"] = pct(values, 0.5), pct(values, 0.99)
    after = [1000 * (r["released"] - returned) for r in rows]
    out["released_after_return_p50"] = pct(after, 0.5)
    out["released_after_return_p99"] = pct(after, 0.99)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def connector_pool_bytes() -> int | None:
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        worker = getattr(conn, "_worker", None)
        if worker is None or worker.pipeline is None:
            return None
        return int(worker.pipeline.pool.allocated_bytes)
    except Exception:
        return None


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One engine configuration, one timed generate; prints a JSON line."""
    import torch
    from vllm import LLM, SamplingParams

    out = tempfile.mkdtemp(prefix="hs-", dir=args.storage)
    trace = Path(tempfile.mkdtemp(prefix="trace-")) / "stages.jsonl"
    if args.kind in ("ours", "forward"):  # the connector's per-sample stage times
        os.environ["HIDDEN_STATE_CONNECTOR_TRACE"] = str(trace)
    llm = LLM(**engine_kwargs(args, args.kind, out))
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    # From the engine's own reservation on (weights, KV cache, CUDA graphs): what the
    # warm-up and the timed run add beyond it, as nvidia-smi sees the engine process.
    smi = None if in_process else DeviceMemoryPoll()
    vocab = 128256 if args.dummy else 250
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True
    )
    repetitive = args.prompt_kind == "repetitive"
    if args.workloads:  # several timed runs (and profiles) of one engine, each warmed
        return _workloads(args, llm, vocab, out, trace, smi)
    warm = random_prompts(min(8, args.num_prompts), args.prompt_len, vocab, 1, repetitive)
    llm.generate([{"prompt_token_ids": p} for p in warm], sampling, use_tqdm=False)
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, 2, repetitive)
    counters = spec_counters(llm) if args.spec else {}
    if in_process:
        torch.cuda.synchronize()
        base_alloc = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    elapsed = time.monotonic() - t0
    paths = [str((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outputs]
    paths = [p for p in paths if p]
    result = _throughput_row(args, paths, t0, elapsed, in_process)
    if args.spec:  # the timed run's drafted and accepted tokens (vLLM's counters)
        after = spec_counters(llm)
        result["spec_counts"] = {k: v - counters.get(k, 0.0) for k, v in after.items()}
    cache = llm.llm_engine.vllm_config.cache_config  # vLLM's KV-cache capacity, as it reports
    result["kv_blocks"] = cache.num_gpu_blocks
    result["kv_block_size"] = cache.block_size
    result["kv_tokens"] = getattr(cache, "kv_cache_size_tokens", None)
    if smi is not None:
        result["peak_extra_device_mb_smi"] = smi.stop()
    if in_process:
        torch.cuda.synchronize()
        result["peak_extra_device_mb"] = (torch.cuda.max_memory_allocated() - base_alloc) / 2**20
        pool = connector_pool_bytes()
        if pool is not None:
            result["pinned_pool_mb"] = pool / 2**20
    if trace.exists():
        result["stages_ms"] = stage_summary(trace, set(paths), t0 + elapsed)
    if paths and args.check:
        result["verified"] = _read_back(paths[:8])
    print("RESULT " + json.dumps(result), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return result


def _workloads(
    args: argparse.Namespace, llm: Any, vocab: int, out: str, trace: Path, smi: Any
) -> dict[str, Any]:
    """``--workloads``: each ``PROMPTSxLENxGENERATED`` (or ``chatN``) timed on this engine.

    ``chatN``: N requests of the chat-like length mix (``chat_mix``); its row adds the
    samples per second (answered, and with every sample written).

    With ``--pyspy``, the first workload then runs twice more under py-spy (every thread
    of this process and the engine's, with their idle time; then only samples holding
    the GIL): raw stacks go to ``--pyspy-out``, the timed rows stay unsampled.
    """
    from vllm import SamplingParams

    result: dict[str, Any] = {}
    for index, spec in enumerate(args.workloads.split(",")):
        if spec.startswith("chat"):
            if not spec[4:].isdigit():
                raise SystemExit(f"--workloads {spec!r}: chatN, N requests (e.g. chat512)")
            ids, replies = chat_mix(int(spec[4:]), vocab, 2 + index)
            n, length, generated = (
                len(ids),
                sum(map(len, ids)) // len(ids),
                sum(replies) // len(ids),
            )
            sampling: Any = [
                SamplingParams(max_tokens=r, temperature=0.0, detokenize=False, ignore_eos=True)
                for r in replies
            ]
        else:
            n, length, generated = (int(x) for x in spec.split("x"))
            repetitive = args.prompt_kind == "repetitive"
            ids = random_prompts(n, length, vocab, 2 + index, repetitive)
            sampling = SamplingParams(
                max_tokens=generated, temperature=0.0, detokenize=False, ignore_eos=True
            )
        run = argparse.Namespace(**{**vars(args), "num_prompts": n, "prompt_len": length})
        run.max_tokens = generated  # the mean, for a chat mix
        prompts = [{"prompt_token_ids": p} for p in ids]
        warm = sampling[:8] if isinstance(sampling, list) else sampling
        llm.generate(prompts[:8], warm, use_tqdm=False)  # this shape warm
        counters = spec_counters(llm) if args.spec else {}
        t0 = time.monotonic()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        elapsed = time.monotonic() - t0
        paths = [str((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outputs]
        paths = [p for p in paths if p]
        result = _throughput_row(run, paths, t0, elapsed, False)
        result["workload"] = spec
        if spec.startswith("chat"):  # exact token counts; samples per second
            result["tok_s"] = sum(map(len, ids)) / elapsed
            result["out_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
            result["samples_s"] = n / elapsed
            if paths:
                published = result["published"]
                result["samples_written_s"] = published / result["all_written_s"]
        if args.spec:  # the timed run's drafted and accepted tokens (vLLM's counters)
            after = spec_counters(llm)
            result["spec_counts"] = {k: v - counters.get(k, 0.0) for k, v in after.items()}
        cache = llm.llm_engine.vllm_config.cache_config
        result["kv_blocks"], result["kv_block_size"] = cache.num_gpu_blocks, cache.block_size
        if trace.exists():
            result["stages_ms"] = stage_summary(trace, set(paths), t0 + elapsed)
        if paths and args.check:
            result["verified"] = _read_back(paths[:8])
        print("RESULT " + json.dumps(result), flush=True)
        _remove(paths)  # the next run writes as much again
        if args.pyspy and index == 0:
            for mode in ("idle", "gil"):
                _profiled(args, llm, prompts, sampling, f"{args.kind}_{spec}_{mode}", mode)
    shutil.rmtree(out, ignore_errors=True)
    if smi is not None:
        smi.stop()
    return result


def _profiled(
    args: argparse.Namespace, llm: Any, prompts: list[Any], sampling: Any, name: str, mode: str
) -> None:
    """One more run of ``prompts`` with py-spy sampling this process tree (raw stacks)."""
    os.makedirs(args.pyspy_out, exist_ok=True)
    target = os.path.join(args.pyspy_out, f"pyspy_{name}.txt")
    cmd = [
        args.pyspy, "record", "--pid", str(os.getpid()), "--subprocesses", "--threads",
        "--nonblocking", "--rate", "200", "--format", "raw", "--output", target,
        "--idle" if mode == "idle" else "--gil",
    ]  # fmt: skip
    spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2.0)  # py-spy attaches to every process of the tree
    t0 = time.monotonic()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed = time.monotonic() - t0
    spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
    try:
        said = spy.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        spy.kill()
        said = spy.communicate()[0]
    log(f"py-spy {name}: {elapsed:.1f} s sampled run; {said.strip()[-300:]}")
    paths = [str((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outputs]
    _remove([p for p in paths if p])


def _remove(paths: list[str]) -> None:
    """Delete published samples once their writers let go (disk space between runs)."""
    wait_released(paths, time.monotonic())
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _throughput_row(
    args: argparse.Namespace, paths: list[str], t0: float, elapsed: float, in_process: bool
) -> dict[str, Any]:
    """Throughput, lock release after ``generate()`` returned, and write rate of one run."""
    release = wait_released(paths, t0) if paths else []
    after_return = [max(0.0, r - elapsed) for r in release]
    drained = max(release) if release else elapsed
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "kind": args.kind,
        "connector": json.loads(args.connector),
        "tp": args.tp,
        "engine": "in-process" if in_process else "multiprocess",
        "storage": args.storage,
        "graphs": args.graphs,
        "prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "spec": args.spec or None,
        "prompt_kind": args.prompt_kind,
        "tok_s": args.num_prompts * args.prompt_len / elapsed,
        "out_tok_s": args.num_prompts * args.max_tokens / elapsed,
        "elapsed_s": elapsed,
        "files": len(paths),
        "all_written_s": drained,
        "release_after_return_p50_ms": 1000 * pct(after_return, 0.5),
        "release_after_return_p99_ms": 1000 * pct(after_return, 0.99),
        "release_after_return_max_ms": 1000 * (max(after_return) if after_return else float("nan")),
    }
    if paths:
        total = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
        result["bytes"] = total
        result["write_gb_s"] = total / drained / 1e9
        result["published"] = sum(1 for p in paths if os.path.exists(p))
        result["failed"] = failed_samples(paths)
    return result


def failed_samples(paths: list[str]) -> int:
    """Samples whose lock records a failure (the sample was answered, never published)."""
    from hidden_state_reader.files.locks import read_status

    return sum(1 for p in paths if not os.path.exists(p) and read_status(p + ".lock").failed)


class DeviceMemoryPoll:
    """Peak GPU memory used (nvidia-smi, every 20 ms) above its value at start, in MiB.

    For multiprocess engines, whose allocations the driving process cannot see through
    torch's allocator statistics.
    """

    def __init__(self) -> None:
        import threading

        self.base = self._used()
        self.peak = self.base
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> float:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5, check=True,
            )  # fmt: skip
            return float(out.stdout.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return float("nan")

    def _run(self) -> None:
        while not self._halt.wait(0.02):
            self.peak = max(self.peak, self._used())

    def stop(self) -> float:
        self._halt.set()
        self._thread.join()
        return self.peak - self.base


def _read_back(paths: list[str]) -> int:
    """How many of these files the reader yields (it raises on any bad one)."""
    from hidden_state_reader import HiddenStateReader

    names = [os.path.basename(p) for p in paths]
    reader = HiddenStateReader(os.path.dirname(paths[0]), names=names, on_error="raise")
    return sum(1 for _ in reader)


def spawn_one(
    args: argparse.Namespace,
    kind: str,
    storage: str,
    extra: list[str],
    env: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "one", "--kind", kind, "--storage", storage, *extra]
    log("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired as exc:
        log(f"TIMED OUT after {args.timeout} s:\n" + str(exc.stderr or "")[-3000:])
        return None
    found = []
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            if args.json:  # append as we go: a time-out keeps what finished
                with open(args.json + "l", "a") as f:
                    f.write(line[7:] + "\n")
            found.append(dict(json.loads(line[7:])))
    if args.workloads and found:
        log(proc.stderr[-2000:] if proc.returncode else "")
        return found[-1]
    if found:
        return found[0]
    log(f"FAILED ({proc.returncode}):\n" + proc.stderr[-4000:])
    return None


# --------------------------------------------------------------------------- validate


def validate(args: argparse.Namespace) -> int:
    """Values on CUDA vs HF transformers, chunked prefill, prefix caching, output tokens."""
    from hidden_state_connector.apps.tiny_model import build_tiny_model
    from hidden_state_reader import HiddenStateReader

    # In-process engine: the path users of notebooks and offline scripts run, and no
    # fork after this process's own CPU torch work (building the model below): a forked
    # engine core hung in an OpenMP barrier at start-up once (bf16, 2026-11-30).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model_dir = build_tiny_model(Path(args.work) / f"tiny-{args.dtype}", dtype=args.dtype)
    out = tempfile.mkdtemp(prefix="hs-val-", dir=args.storage)
    outs = _validation_outputs(_validation_engine(args, model_dir, out))
    names = [os.path.basename(o.kv_transfer_params["hidden_states_path"]) for o in outs]
    # names= yields a sample still being written after the complete ones: match by name.
    read = HiddenStateReader(out, names=names, on_error="raise", verify_checksum=True)
    by_name = {os.path.basename(s.path): s for s in read}
    samples = [by_name[n] for n in names]
    tol = 3e-3 if args.dtype == "float32" else 3e-2  # TF32 matmuls in HF on CUDA
    storage = json.loads(args.connector).get("storage_dtype", "model")
    if storage == "fp8_e4m3":
        tol += 2**-4  # fp8's documented bound (docs/format.md), on top of vLLM vs HF
    worst, layer0_worst, failures = _compare_with_hf(model_dir, outs, samples, tol)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "kind": "validate",
        "tp": args.tp,
        "dtype": args.dtype,
        "storage_dtype": storage,
        "graphs": args.graphs,
        "samples": len(samples),
        "tolerance": tol,
        "worst_rel_err": worst,
        "layer0_rel_err": layer0_worst,
        "layer_ids": samples[0].layer_ids,
        "failures": failures[:10],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failures else 0


def _validation_engine(args: argparse.Namespace, model_dir: Path, out: str) -> Any:
    """The tiny model with prefix caching and small prefill chunks, capturing 4 layers."""
    from vllm import LLM

    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    settings = {
        "chunk_bytes": 65536,
        "host_buffer_bytes": 1 << 20,
        "checksum": True,
        "stats_interval": 0,
        **json.loads(args.connector),  # e.g. {"storage_dtype": "fp8_e4m3"}
    }
    return LLM(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=4096,
        enforce_eager=not args.graphs,
        attention_backend="TRITON_ATTN",
        gpu_memory_utilization=0.3,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=256,
        seed=0,
        speculative_config=speculative_config([4, 1, 2, 0]),
        kv_transfer_config={
            **kv_transfer_config(out, settings),
            "kv_connector_module_path": "hidden_state_connector.connector",
        },
    )


def _validation_outputs(llm: Any) -> list[Any]:
    """Prompts of many lengths, two groups sharing a cached prefix, one with output tokens."""
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 250, (96,), generator=gen).tolist()
    prompts = [
        torch.randint(0, 250, (n,), generator=gen).tolist() for n in (1, 7, 16, 17, 129, 300, 2000)
    ]
    prompts += [shared + torch.randint(0, 250, (5 + i,), generator=gen).tolist() for i in range(4)]
    prompts += [shared + torch.randint(0, 250, (9 + i,), generator=gen).tolist() for i in range(4)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # The second group reuses the shared prefix from the prefix cache.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:-4]], sp, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[-4:]], sp, use_tqdm=False)
    sp_out = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"include_output_tokens": True}},
    )
    outs += llm.generate([{"prompt_token_ids": prompts[4]}], sp_out, use_tqdm=False)
    return list(outs)


def _compare_with_hf(
    model_dir: Path, outs: list[Any], samples: list[Any], tol: float
) -> tuple[float, float, list[str]]:
    """Worst relative error vs HF (layers > 0), layer 0's worst, and what failed."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    last: dict[str, torch.Tensor] = {}
    hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("x", o[0] if isinstance(o, tuple) else o)
    )
    worst = 0.0
    layer0_worst = 0.0  # vLLM's fused add-RMSNorm updates it in place on CUDA (documented)
    failures = []
    for o, s in zip(outs, samples, strict=True):
        expect_tokens = list(o.prompt_token_ids)
        if len(o.outputs[0].token_ids) > 1:
            expect_tokens += list(o.outputs[0].token_ids)[:-1]
        if s.token_ids.tolist() != expect_tokens:
            failures.append(f"{s.path}: token ids differ")
            continue
        with torch.no_grad():
            ref = hf(s.token_ids[None].cuda(), output_hidden_states=True)
        for pos, lid in enumerate(s.layer_ids or []):
            exp = last["x"][0] if lid == 4 else ref.hidden_states[lid][0]
            got = s.hidden_states[:, pos].float().cuda()
            err = ((got - exp).norm() / exp.norm()).item()
            if lid == 0:
                layer0_worst = max(layer0_worst, err)
                continue
            worst = max(worst, err)
            if not err < tol:
                failures.append(f"{os.path.basename(s.path)} layer {lid}: rel err {err:.2e}")
    return worst, layer0_worst, failures


# --------------------------------------------------------------------------- suites


def table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    widths = [max([len(k), *(len(_fmt(r.get(k))) for r in rows)]) for k in keys]
    line = " | ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))
    sep = "-|-".join("-" * w for w in widths)
    body = [
        " | ".join(_fmt(r.get(k)).ljust(w) for k, w in zip(keys, widths, strict=True)) for r in rows
    ]
    return "\n".join([line, sep, *body])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3f}"
    return "" if v is None else str(v)


def suite_throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    base = [
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--check",
        "--connector",
        args.connector,
        "--max-tokens",
        str(args.max_tokens),
        "--max-model-len",
        str(args.max_model_len),
        "--prompt-kind",
        args.prompt_kind,
    ]
    if args.spec:
        base += ["--spec", args.spec]
    if args.dummy:
        base.append("--dummy")
    if args.workloads:
        base += ["--workloads", args.workloads]
    if args.pyspy:
        base += ["--pyspy", args.pyspy, "--pyspy-out", args.pyspy_out]
    for graphs in args.graph_modes:
        g = ["--graphs"] if graphs else []
        for storage in args.storages:
            # Interleave kinds so drift during the run hits all of them alike.
            for rep in range(args.repeats):
                for kind in args.kinds:
                    r = spawn_one(args, kind, storage, base + g)
                    if r:
                        r["rep"] = rep
                        rows.append(r)
    return rows


def suite_long(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    extra = [
        "--model",
        args.model,
        "--max-tokens",
        str(args.max_tokens),
        "--num-prompts",
        "2",
        "--prompt-len",
        str(args.long_len),
        "--max-model-len",
        str(args.long_len + 64),
        "--max-num-batched-tokens",
        "8192",
    ]
    if args.dummy:
        extra.append("--dummy")
    # In-process by default (torch's peak statistics); --long-multiprocess runs vLLM's
    # default layout and reads the device memory with nvidia-smi instead (vLLM's example
    # connector saves on a thread pool that an in-process engine stops driving).
    env = {} if args.long_multiprocess else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for kind in args.kinds:
        r = spawn_one(args, kind, args.storages[0], extra, env)
        if r:
            rows.append(r)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line (an argparse table)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["validate", "throughput", "long", "tp2", "one", "all"])
    parser.add_argument("--kind", default="ours")
    parser.add_argument("--model", default="")
    parser.add_argument("--dummy", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--layers", type=lambda s: [int(x) for x in s.split(",")], default=LAYERS_8B
    )
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--long-len", type=int, default=32768)
    parser.add_argument("--long-multiprocess", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt")
    parser.add_argument("--gpu-mem", type=float, default=0.85)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--graph-modes", default="eager", help="eager,graphs")
    parser.add_argument("--storage", default="/tmp")
    parser.add_argument("--storages", default="/tmp")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kinds", default="none,example,ours")
    parser.add_argument("--connector", default="{}", help="extra connector config JSON")
    parser.add_argument(
        "--spec", default="", choices=["", *SPEC_CONFIGS], help="a drafter (kinds none, forward)"
    )
    parser.add_argument("--prompt-kind", default="random", choices=["random", "repetitive"])
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--workloads",
        default="",
        help="PROMPTSxLENxGENERATED or chatN (prompts 200-4,000, replies 100-1,000),... "
        "timed on one engine each kind",
    )
    parser.add_argument("--pyspy", default="", help="py-spy binary: profile the first workload")
    parser.add_argument("--pyspy-out", default="/tmp/out/pyspy")
    parser.add_argument("--work", default="/tmp/hs-bench")
    parser.add_argument("--json", default="")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine run")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    args.graph_modes = [m == "graphs" for m in args.graph_modes.split(",")]
    args.storages = args.storages.split(",")
    args.kinds = args.kinds.split(",")
    if args.command == "one":
        run_one(args)
        return 0
    if args.command == "validate":
        return validate(args)
    os.makedirs(args.work, exist_ok=True)
    if not args.model:
        args.model = str(make_8b_model(Path(args.work)))
        args.dummy = True
    rows: list[dict[str, Any]] = []
    if args.command in ("throughput", "all"):
        rows += suite_throughput(args)
        print(table(rows, THROUGHPUT_COLUMNS))
    if args.command in ("long", "all"):
        long_rows = suite_long(args)
        print(table(long_rows, LONG_COLUMNS))
        rows += long_rows
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


THROUGHPUT_COLUMNS = [
    "kind",
    "storage",
    "graphs",
    "max_tokens",
    "spec",
    "tok_s",
    "out_tok_s",
    "write_gb_s",
    "release_after_return_p50_ms",
    "release_after_return_p99_ms",
    "all_written_s",
    "files",
]
LONG_COLUMNS = [
    "kind",
    "prompt_len",
    "tok_s",
    "peak_extra_device_mb",
    "peak_extra_device_mb_smi",
    "pinned_pool_mb",
]


if __name__ == "__main__":
    sys.exit(main())
