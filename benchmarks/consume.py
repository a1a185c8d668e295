"""Consume: a producer at a fixed rate, N reader processes with a consumer group's defaults.

    python -m benchmarks --only consume [--quick]        # a section of docs/benchmarks.md
    python -m benchmarks.consume [--quick] [--readers 3] [--rate 36] [--samples 400]
        [--tokens 1024] [--kinds "bf16,fp8,fp8 device"] [--json OUT]  # e.g. on a GPU host
    python -m benchmarks.consume --check-device cuda     # device=... reads == CPU reads?

One producer process publishes samples at a fixed rate the way the connector does
(lock, complete file under its final name, unlock; or a store put plus commit record),
from files written beforehand, so its own cost is small: it stands for a GPU engine.
``readers`` processes follow the directory (or store) with ``follow=True, claim=True,
on_consumed="delete"`` and otherwise default options (``device`` in the device rows)
and touch every byte of what they get (``benchmarks.consume_roles``). Kinds:

* ``bf16``, ``fp8``: files stored in the model's dtype, or as ``fp8_e4m3`` (dequantized
  on the CPU by the reader);
* ``bf16 device``, ``fp8 device``: the same with ``device="cuda"`` (only where CUDA is);
* ``store``: bf16 samples through a Mooncake Store over loopback (needs root, unshare and
  Mooncake; run in a loopback-only network namespace as ``benchmarks.store``).

Reported per kind: samples produced and consumed (each exactly once), GB delivered per
CPU-second of a reader process (bf16 bytes for fp8 files; all its threads, from its
first request to its last sample: the rate one reader sustains per core, which waiting
for the producer or the claim group does not change), the raw read of the same samples
(``open``/``preadv`` into a fresh buffer per file, touched; the store: ``get_into`` a
registered buffer), GB/s per reader while busy (wall time from the moment a sample was
both published and asked for until it had been touched), the largest backlog (published,
not yet yielded) and the yield latency (publication -> yield) p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import child_env, fmt, goal, log, median, percentile, python_module, table

NAME = "consume"
TITLE = "15. Consume: a producer at a fixed rate, N follow + claim + delete readers"
GOAL_FP8 = 0.5
RATE = "gb_per_reader_cpu_s"
"""What a reader can sustain: delivered GB per CPU-second of its process (waits cost none)."""
WARMUP = 2
"""Each reader's first samples, whose buffers are new (page faults), are reported apart."""
KINDS = {  # kind -> (storage, device, backend)
    "bf16": ("model", None, "files"),
    "fp8": ("fp8_e4m3", None, "files"),
    "bf16 device": ("model", "cuda", "files"),
    "fp8 device": ("fp8_e4m3", "cuda", "files"),
    "store": ("model", None, "store"),
}
STORE_URL = "mooncake://127.0.0.1:50051/consume?hostname=127.0.0.1&buffer=128MiB"


@dataclass(frozen=True)
class Plan:
    """Sizes and pace of one run (``tokens x layers x hidden`` bf16 samples)."""

    tokens: int
    layers: int
    hidden: int
    samples: int
    rate: float  # samples per second
    readers: int
    idle: float  # the readers' idle_timeout, seconds
    staged: int = 4  # distinct files the producer publishes in turn
    rounds: int = 1  # every kind once per round, kinds interleaved (drift hits all alike)

    @property
    def bf16_bytes(self) -> int:
        return self.tokens * (8 + self.layers * self.hidden * 2)


QUICK = Plan(tokens=64, layers=4, hidden=1024, samples=12, rate=40.0, readers=2, idle=2.0)
FULL = Plan(tokens=1024, layers=4, hidden=4096, samples=48, rate=12.0, readers=2, idle=3.0,
            rounds=3)  # fmt: skip


def available(kinds: list[str]) -> tuple[list[str], dict[str, str]]:
    """The kinds that can run here, and why each other one cannot."""
    import torch

    from benchmarks.store import unavailable

    skipped = {}
    store_why = unavailable()
    for kind in kinds:
        _, device, backend = KINDS[kind]
        if device == "cuda" and not torch.cuda.is_available():
            skipped[kind] = "no CUDA device here"
        elif backend == "store" and store_why:
            skipped[kind] = store_why
    return [k for k in kinds if k not in skipped], skipped


def stage(root: Path, storage: str, plan: Plan) -> list[str]:
    """``plan.staged`` distinct sample files of ``storage`` (written once, published many times)."""
    import torch

    from hidden_state_reader.files.publish import write_sample
    from hidden_state_reader.format import sample_metadata

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(plan.staged):
        hidden = torch.randn(plan.tokens, plan.layers, plan.hidden, generator=gen)
        path = write_sample(root / f"staged-{i}.safetensors", torch.arange(plan.tokens),
                            hidden.bfloat16(), storage=storage, checksum=True,
                            metadata=sample_metadata(layer_ids=list(range(plan.layers))),
                            use_lock=False)  # fmt: skip
        paths.append(str(path))
    return paths


def raw_read(paths: list[str], delivered: int, rounds: int = 3) -> float:
    """GB/s of delivered bytes when a raw loop reads the same files (fresh buffer, touched)."""
    import torch

    from benchmarks.reader import touch

    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                buf = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8)
                view, done = buf.numpy().data, 0
                while done < len(view):
                    done += os.preadv(fd, [view[done:]], done)
            finally:
                os.close(fd)
            touch(buf)
        best = min(best, time.perf_counter() - started)
    return delivered * len(paths) / best / 1e9


def _roles(*args: str) -> list[str]:
    return python_module("benchmarks.consume_roles", *args)


def run_kind(
    source: str,
    producer: Callable[[str], list[str]],
    plan: Plan,
    device: str | None,
    work: Path,
) -> dict[str, Any]:
    """Start the readers, then the producer (``producer(out)`` is its command); the figures."""
    work.mkdir(parents=True, exist_ok=True)
    outs = [work / f"reader-{i}.json" for i in range(plan.readers)]
    readers = [
        subprocess.Popen(
            _roles("read", source, str(out), str(plan.idle), device or ""),
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for out in outs
    ]
    produced = work / "producer.json"
    # The producer connects (imports, store client) while the readers start; it publishes
    # only once every process is ready, so no reader's idle timeout runs out before the
    # first sample however slow a loaded machine starts processes.
    writer = subprocess.Popen(producer(str(produced)), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    try:
        for role, proc in [("reader", p) for p in readers] + [("producer", writer)]:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {role} did not start (exit {proc.wait()})")
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.close()
        if writer.wait(timeout=900):
            raise RuntimeError(f"the producer failed (exit {writer.returncode})")
        for proc in readers:
            if proc.wait(timeout=300 + plan.idle):
                raise RuntimeError(f"a reader failed (exit {proc.returncode})")
    finally:
        for proc in [*readers, writer]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    published = json.loads(produced.read_text())["published"]
    return metrics(published, [json.loads(out.read_text()) for out in outs])


def metrics(published: list[list[Any]], readers: list[dict[str, Any]]) -> dict[str, Any]:
    """Exactly-once counts, per-reader busy GB/s, backlog and latency from the records.

    A record is ``[name, asked, got, done, nbytes, cpu]`` (wall-clock seconds; ``cpu``: the
    reader process's CPU seconds by ``done``); a reader is busy with a sample from when it
    was both published and asked for until it was done. The CPU rate is the steady
    state: after each reader's first ``WARMUP`` samples, whose CPU is reported apart.
    """
    at = {name: t for name, t in published}
    records = [r for reader in readers for r in reader["records"]]
    names = [r[0] for r in records]
    busy_rates, cpu_rates, warmup_ms = [], [], []
    for reader in readers:
        mine = reader["records"]
        busy = sum((r[2] - max(r[1], at[r[0]])) + (r[3] - r[2]) for r in mine)
        if busy > 0:
            busy_rates.append(sum(r[4] for r in mine) / busy / 1e9)
        if len(mine) > WARMUP:
            steady = mine[-1][5] - mine[WARMUP - 1][5]
            warmup_ms.append(1000 * mine[WARMUP - 1][5] / WARMUP)
            if steady > 0:
                cpu_rates.append(sum(r[4] for r in mine[WARMUP:]) / steady / 1e9)
    latency = [(r[2] - at[r[0]]) * 1e3 for r in records if r[0] in at]
    events = sorted([(t, 1) for t in at.values()] + [(r[2], -1) for r in records])
    backlog = peak = 0
    for _, step in events:
        backlog += step
        peak = max(peak, backlog)
    wall = max((r[3] for r in records), default=0.0) - min(at.values(), default=0.0)
    delivered = sum(r[4] for r in records)
    return {
        "produced": len(at),
        "consumed": len(set(names)),
        "duplicates": len(names) - len(set(names)),
        "unknown": len(set(names) - set(at)),
        "per_reader_busy_gb_s": busy_rates,
        "gb_s_per_reader_busy": median(busy_rates),
        "per_reader_gb_per_cpu_s": cpu_rates,
        "gb_per_reader_cpu_s": median(cpu_rates),
        "warmup_cpu_ms_per_sample": median(warmup_ms),
        "delivered_gb_s_wall": delivered / wall / 1e9 if wall > 0 else 0.0,
        "max_backlog_files": peak,
        "yield_latency_p50_ms": percentile(latency, 50),
        "yield_latency_p99_ms": percentile(latency, 99),
    }


def files_kind(kind: str, plan: Plan, work: Path, staged: list[str]) -> dict[str, Any]:
    """One file-backed kind: a fresh directory, the producer linking staged files into it."""
    _, device, _ = KINDS[kind]
    directory = work / kind.replace(" ", "-")
    directory.mkdir()

    def producer(out: str) -> list[str]:
        return _roles("produce", str(directory), out, str(plan.samples), str(plan.rate), *staged)

    return run_kind(str(directory), producer, plan, device, work / f"{directory.name}-logs")


def store_kind(plan: Plan, work: Path, staged: list[str]) -> dict[str, Any]:
    """The store kind, run in a loopback-only network namespace (``--inside-store``)."""
    argv = [sys.executable, "-m", "benchmarks.consume", "--inside-store", json.dumps(asdict(plan)),
            str(work), *staged]  # fmt: skip
    cmd = "ip link set lo up && exec " + " ".join(f"'{a}'" for a in argv)
    out = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True,
                         env=child_env(), timeout=1800)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"the store kind failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _inside_store(plan: Plan, work: Path, staged: list[str]) -> dict[str, Any]:
    from benchmarks.store import _start_store
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.url import parse_store_url

    logs = work / "store-logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = _start_store(logs, "2GB")
    try:
        client = StoreClient(parse_store_url(STORE_URL))
        raw = raw_store(client, staged, plan.bf16_bytes)

        def producer(out: str) -> list[str]:
            return _roles("produce-store", STORE_URL, out, str(plan.samples), str(plan.rate),
                          *staged)  # fmt: skip

        result = run_kind(STORE_URL, producer, plan, None, logs)
        client.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {**result, "raw_gb_s": raw}


def raw_store(client: Any, staged: list[str], delivered: int, rounds: int = 3) -> float:
    """GB/s of delivered bytes of ``get_into`` a registered buffer: the store's limit."""
    import numpy as np

    keys = []
    for i, path in enumerate(staged):
        keys.append(f"consume-raw-{i}")
        client.put(keys[-1], Path(path).read_bytes())
    size = max(client.size(k) or 0 for k in keys)
    buf = np.empty(size, dtype=np.uint8)
    client.raw_store.register_buffer(buf.ctypes.data, size)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for key in keys:
            client.raw_store.get_into(key, buf.ctypes.data, size)
        best = min(best, time.perf_counter() - started)
    client.raw_store.unregister_buffer(buf.ctypes.data)
    for key in keys:
        client.remove(key)
    return delivered * len(keys) / best / 1e9


def measure(plan: Plan, work: Path, kinds: list[str]) -> dict[str, Any]:
    """Every kind that can run here, once per round, the kinds interleaved.

    Each run has the machine to itself; running the kinds in turn, round after round,
    lets drift in the machine's speed hit every kind alike, and ratios between kinds are
    taken per round (``combine``).
    """
    runnable, skipped = available(kinds)
    staged: dict[str, list[str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in runnable}
    for round_no in range(plan.rounds):
        for kind in runnable:
            storage, _, backend = KINDS[kind]
            if storage not in staged:
                staged[storage] = stage(work / f"staged-{storage}", storage, plan)
            log(f"consume: {kind}, round {round_no + 1} of {plan.rounds}, {plan.readers} "
                f"readers, {plan.samples} samples at {plan.rate}/s")  # fmt: skip
            here = work / f"round-{round_no}"
            here.mkdir(exist_ok=True)
            if backend == "store":
                run = store_kind(plan, here, staged[storage])
            else:
                run = files_kind(kind, plan, here, staged[storage])
                run["raw_gb_s"] = raw_read(staged[storage], plan.bf16_bytes)
            runs[kind].append(run)
    rows = {kind: {**combine(results), "storage": KINDS[kind][0], "device": KINDS[kind][1],
                   "backend": KINDS[kind][2]} for kind, results in runs.items()}  # fmt: skip
    from hidden_state_reader.kernels.fp8_cpu import kernel

    return {"plan": asdict(plan), "kinds": rows, "skipped": skipped, "fp8_kernel": kernel(),
            "loadavg": list(os.getloadavg())}  # fmt: skip


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One kind's rounds: counts summed, rates the median round's, the worst backlog and p99.

    The per-round figures stay under ``rounds`` (ratios between kinds use them).
    """
    total = {key: sum(r[key] for r in runs) for key in ("produced", "consumed", "duplicates",
                                                       "unknown")}  # fmt: skip
    return {
        **total,
        "gb_s_per_reader_busy": median([r["gb_s_per_reader_busy"] for r in runs]),
        "per_reader_busy_gb_s": [x for r in runs for x in r["per_reader_busy_gb_s"]],
        "gb_per_reader_cpu_s": median([r["gb_per_reader_cpu_s"] for r in runs]),
        "warmup_cpu_ms_per_sample": median([r["warmup_cpu_ms_per_sample"] for r in runs]),
        "per_reader_gb_per_cpu_s": [x for r in runs for x in r["per_reader_gb_per_cpu_s"]],
        "delivered_gb_s_wall": median([r["delivered_gb_s_wall"] for r in runs]),
        "raw_gb_s": median([r["raw_gb_s"] for r in runs]),
        "max_backlog_files": max(r["max_backlog_files"] for r in runs),
        "yield_latency_p50_ms": median([r["yield_latency_p50_ms"] for r in runs]),
        "yield_latency_p99_ms": max(r["yield_latency_p99_ms"] for r in runs),
        "rounds": runs,
    }


def round_ratio(rows: dict[str, Any], kind: str, base: str, key: str = RATE) -> float:
    """Median over rounds of ``kind``'s ``key`` (a rate) over ``base``'s."""
    one = [rows[kind]]  # a result without rounds: one round
    pairs = zip(rows[kind].get("rounds", one), rows[base].get("rounds", [rows[base]]), strict=True)
    return median([a[key] / b[key] for a, b in pairs])


def _goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = res["kinds"]
    out = [
        goal(f"consume ({kind}): samples consumed exactly once / produced",
             (r["consumed"] - r["duplicates"] - r["unknown"]) / max(1, r["produced"]), 1.0)
        for kind, r in rows.items()
    ]  # fmt: skip
    if "bf16" in rows and "fp8" in rows:
        ratio = round_ratio(rows, "fp8", "bf16")
        out.append(goal("consume: fp8 files / bf16 files, GB delivered per reader CPU-second "
                        "(default options, dequantized on the CPU)", ratio, GOAL_FP8))  # fmt: skip
    return out


def run(ctx: Any) -> dict[str, Any]:
    plan = ctx.pick(QUICK, FULL)
    res = measure(plan, ctx.workdir(NAME), list(KINDS))
    res["goals"] = _goals(res)
    return res


HEADER = ["kind", "produced", "consumed", "GB per reader CPU-s", "first samples: CPU ms each",
          "raw read GB/s", "÷ raw",
          "÷ bf16 files", "GB/s per reader, busy (wall)", "delivered GB/s (wall)",
          "max backlog (files)", "yield p50 / p99 ms"]  # fmt: skip


def render(res: dict[str, Any]) -> str:
    p = res["plan"]
    size = p["tokens"] * (8 + p["layers"] * p["hidden"] * 2)
    rows = []
    kinds = res["kinds"]
    for kind, r in kinds.items():
        rate = r.get(RATE)
        latency = f"{fmt(r['yield_latency_p50_ms'])} / {fmt(r['yield_latency_p99_ms'])}"
        rows.append(
            [kind, r["produced"], f"{r['consumed']} ({r['duplicates']} twice)", rate,
             r.get("warmup_cpu_ms_per_sample"), r["raw_gb_s"],
             rate / r["raw_gb_s"] if rate else None,
             round_ratio(kinds, kind, "bf16") if "bf16" in kinds and rate else None,
             r["gb_s_per_reader_busy"], r["delivered_gb_s_wall"], r["max_backlog_files"],
             latency]
        )  # fmt: skip
    out = [
        f'{p["readers"]} reader processes (`follow=True, claim=True, on_consumed="delete"`, '
        f"otherwise defaults), one producer at {fmt(p['rate'])} samples/s "
        f"({fmt(p['rate'] * size / 1e9)} GB/s of bf16), {p['samples']} samples of "
        f"{p['tokens']} tokens x {p['layers']} layers x {p['hidden']} ({fmt(size / 2**20)} MiB "
        'in bf16). GB are of delivered bytes (bf16 for fp8 files). "GB per reader CPU-s": '
        "delivered bytes over the CPU time of the reader process (all its threads) while it "
        f"made its samples after the first {WARMUP}: the rate one reader sustains per core, "
        "whatever it waited for meanwhile (the first samples' buffers are new: their CPU "
        "per sample is the next column); raw: a raw read loop over the same samples, CPU-bound "
        "(files: `preadv` into a fresh buffer; store: `get_into` a registered buffer). "
        '"busy (wall)": wall time from the moment a sample was both published and asked '
        "for until the reader had touched it (includes the claim group's batched watch, "
        "up to 6.25 ms per member; see section 16). "
        f"{p.get('rounds', 1)} round(s), the kinds interleaved: rates are the median round's, "
        '"÷ bf16 files" the median of per-round ratios, counts summed over rounds, the '
        f"backlog and p99 the worst round's. fp8 dequantization: {res.get('fp8_kernel', '?')}.",
        "",
        table(HEADER, rows),
    ]
    for kind, why in res.get("skipped", {}).items():
        out += ["", f"`{kind}` not measured: {why}."]
    return "\n".join(out)


def findings(res: dict[str, Any]) -> list[str]:
    rows = res["kinds"]
    parts = [
        f"{kind} {r[RATE]:.2f} GB per CPU-second ({r[RATE] / r['raw_gb_s']:.2f}\u00d7 raw), "
        f"p99 {r['yield_latency_p99_ms']:.0f} ms, max backlog {r['max_backlog_files']}"
        for kind, r in rows.items()
        if r.get(RATE)
    ]
    fp8 = ""
    if "bf16" in rows and "fp8" in rows:
        fp8 = f" fp8 / bf16: {round_ratio(rows, 'fp8', 'bf16'):.2f}\u00d7 (goal \u2265 {GOAL_FP8})."
    return ["**Consume** (per reader process, default options): " + "; ".join(parts) + "." + fp8]


def check_device(device: str, work: Path) -> dict[str, Any]:
    """Load one bf16 and one fp8 sample with ``device=`` and on the CPU: are they identical?

    For the integrator on a GPU host (``--check-device cuda``); the tests run it with
    ``device="cpu"``.
    """
    import torch

    from hidden_state_reader import LoadOptions, load_sample
    from hidden_state_reader.files.publish import write_sample

    x = torch.randn(64, 3, 256).bfloat16()
    mask = torch.arange(64) % 3 == 0
    out: dict[str, Any] = {"device": device}
    for storage in ("model", "fp8_e4m3"):
        path = write_sample(work / f"check-{storage}.safetensors", torch.arange(64), x,
                            storage=storage, loss_mask=mask)  # fmt: skip
        cpu = load_sample(path)
        moved = load_sample(path, LoadOptions(device=device))
        pairs = [
            (moved.token_ids, cpu.token_ids),
            (moved.hidden_states, cpu.hidden_states),
            (moved.loss_mask, cpu.loss_mask),
        ]
        same = all(
            a is not None
            and b is not None
            and a.device.type == torch.device(device).type
            and torch.equal(a.cpu(), b)
            for a, b in pairs
        )
        out[storage] = {"identical": same, "dtype": str(moved.hidden_states.dtype)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='example: python -m benchmarks.consume --readers 3 --rate 36 --samples 400 '
        '--kinds "bf16,fp8,fp8 device" --json /tmp/consume.json',
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny samples (seconds)")
    parser.add_argument("--readers", type=int, help="reader processes")
    parser.add_argument("--rate", type=float, help="samples per second")
    parser.add_argument("--samples", type=int, help="samples per kind")
    parser.add_argument("--tokens", type=int, help="tokens per sample")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: "
                        + ", ".join(KINDS))  # fmt: skip
    parser.add_argument("--json", default="", help="also write the result here")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--check-device", default="", metavar="DEVICE",
                        help="only check that device=DEVICE reads equal CPU reads")  # fmt: skip
    parser.add_argument("--inside-store", default="", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_store:
        plan = Plan(**json.loads(args.inside_store))
        print(json.dumps(_inside_store(plan, Path(args.rest[0]), args.rest[1:])))
        return
    work = Path(tempfile.mkdtemp(prefix="consume-", dir=args.scratch))
    try:
        if args.check_device:
            result = check_device(args.check_device, work)
        else:
            changes = {k: getattr(args, k) for k in ("readers", "rate", "samples", "tokens")
                       if getattr(args, k) is not None}  # fmt: skip
            plan = replace(QUICK if args.quick else FULL, **changes)
            kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
            unknown = [k for k in kinds if k not in KINDS]
            if unknown:
                parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
            result = measure(plan, work, kinds)
            result["goals"] = _goals(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
