"""Shared helpers of the reliability suite (tests/reliability) and its tool processes.

Samples written by the fault-injection tools carry their own expected content in their
name, so any reader can check a yielded sample bit for bit without a side channel:
``PREFIX-t{tokens}-l{layers}-h{hidden}-{dtype}.safetensors``. Token ids and hidden
states are a cheap deterministic function of the name (see ``pattern_tensors``); a
partial, shifted or zero-filled sample can never match.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hidden_state_reader.files.locks import probe
from hidden_state_reader.format import LockState, classify
from hidden_state_reader.format.names import Kind

from procs import free_port

# A live server answers /health at once; on a loaded machine it may take seconds.
HEALTH_TIMEOUT = 30.0
TESTS = Path(__file__).resolve().parents[1]
TOOLS = TESTS / "tools"
RESULTS = TESTS / "reliability" / ".results"
CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_NAME = re.compile(r"-t(\d+)-l(\d+)-h(\d+)-(bf16|f16|f32)\.safetensors$")
# One shared pattern of small integers (|v| <= 125: exact in bf16, f16 and f32); each
# sample reads it from its own offset.
_PATTERN_LEN = 1 << 22
_PATTERN: torch.Tensor | None = None


def _pattern() -> torch.Tensor:
    global _PATTERN
    if _PATTERN is None:
        idx = torch.arange(_PATTERN_LEN + 4096, dtype=torch.int64)
        _PATTERN = ((idx * 2654435761) % 251).to(torch.float32) - 125.0
    return _PATTERN


def sample_name(prefix: str, tokens: int, layers: int, hidden: int, dtype: str = "bf16") -> str:
    """The file name that encodes a sample's shape (and so its expected content)."""
    return f"{prefix}-t{tokens}-l{layers}-h{hidden}-{dtype}.safetensors"


def pattern_tensors(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids and hidden states a sample called ``name`` must hold."""
    m = _NAME.search(name)
    if m is None:
        raise ValueError(f"not a pattern sample name: {name}")
    tokens, layers, hidden = (int(m.group(i)) for i in (1, 2, 3))
    dtype = _DTYPES[m.group(4)]
    seed = zlib.crc32(name.encode())
    n = tokens * layers * hidden
    if n > _PATTERN_LEN:
        raise ValueError(f"{name}: {n} elements, more than the pattern holds")
    offset = seed % 4096
    hidden_states = _pattern()[offset : offset + n].reshape(tokens, layers, hidden).to(dtype)
    token_ids = (torch.arange(tokens, dtype=torch.int64) * 7 + seed) % 50000
    return token_ids, hidden_states


def matches_pattern(sample: Any) -> bool:
    """Whether a yielded ``Sample`` holds exactly what its name promises."""
    token_ids, hidden_states = pattern_tensors(os.path.basename(sample.path))
    return bool(
        torch.equal(sample.token_ids, token_ids)
        and sample.hidden_states.dtype == hidden_states.dtype
        and torch.equal(sample.hidden_states, hidden_states)
    )


# -- the hidden-state CLI ------------------------------------------------------------


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``hidden-state ARGS`` as a subprocess."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def verify(directory: str | os.PathLike[str], grace: float = 0.0) -> tuple[int, dict[str, Any]]:
    """``hidden-state verify --json``: (exit status, report)."""
    proc = cli("verify", os.fspath(directory), "--json", "--grace", str(grace))
    assert proc.returncode in (0, 1), f"verify failed: {proc.returncode}\n{proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def problem_states(report: Mapping[str, Any]) -> dict[str, int]:
    """Count the problems of a verify report by state."""
    counts: dict[str, int] = {}
    for p in report["problems"]:
        counts[p["state"]] = counts.get(p["state"], 0) + 1
    return counts


def clean(directory: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """``hidden-state clean --older-than 0``."""
    proc = cli("clean", os.fspath(directory), "--older-than", "0")
    assert proc.returncode == 0, f"clean failed: {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc


def report_then_clean(
    directory: str | os.PathLike[str], allowed: set[str], ready: int
) -> tuple[dict[str, int], tuple[int, dict[str, Any]]]:
    """A fault's leftovers: ``verify`` reports only problems of the ``allowed`` states and
    ``ready`` complete samples (exit 1 exactly when it reports any); then ``clean`` runs.

    Returns the problems by state and ``verify``'s (exit status, report) after cleaning.
    """
    rc, report = verify(directory)
    problems = problem_states(report)
    assert set(problems) <= allowed, report["problems"][:5]
    assert rc == (1 if problems else 0)
    assert report["states"].get("ready", 0) == ready
    clean(directory)
    return problems, verify(directory)


# -- directory inspection ------------------------------------------------------------


def entries(directory: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Names in a storage root by kind (data, lock, temp, other; hidden ones left out)."""
    out: dict[str, list[str]] = {"data": [], "lock": [], "temp": [], "other": []}
    for name in os.listdir(directory):
        if name.startswith("."):
            continue
        out[classify(name).value].append(name)
    return out


def held_locks(directory: str | os.PathLike[str]) -> int:
    """Lock files in ``directory`` whose lock is held right now (non-blocking probe)."""
    held = 0
    for name in os.listdir(directory):
        if classify(name) is Kind.LOCK:
            try:
                if probe(os.path.join(directory, name)) is LockState.HELD:
                    held += 1
            except OSError:
                continue
    return held


def files_under(path: str | os.PathLike[str]) -> list[str]:
    """Every file (and symlink) below ``path``, relative, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            found.append(os.path.relpath(os.path.join(dirpath, n), path))
    return sorted(found)


# -- servers -------------------------------------------------------------------------

LAYERS = [1, 2, 4]
"""Captured layers of the tiny model: 3 x 128 bf16 = 768 bytes per token."""
TOKEN_BYTES = len(LAYERS) * 128 * 2


def serve_options(
    model: Path,
    out_dir: str | os.PathLike[str],
    *,
    kv_cache_bytes: int = 512 * 1024**2,
    **connector: Any,
) -> Any:
    """A small, CPU-friendly ``vllm serve`` configuration writing to ``out_dir``."""
    from hidden_state_connector.apps.server import ServeOptions

    return ServeOptions(
        model=str(model),
        out_dir=os.fspath(out_dir),
        layer_ids=LAYERS,
        port=free_port(),
        connector={"stats_interval": 0, "num_writer_threads": 4, **connector},
        vllm_args=[
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "512",
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--enforce-eager",
            "--served-model-name",
            "tiny",
        ],
    )


def log_count(server: Any, text: str, at_least: int, timeout: float = 15.0) -> int:
    """How often ``text`` appears in the server's log, waiting up to ``timeout`` seconds
    for it to reach ``at_least`` (another process writes the log, a moment later than the
    lock release or the HTTP answer a test has just seen)."""
    deadline = time.monotonic() + timeout
    while True:
        count = server.tail(1_000_000).count(text)
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.2)  # polling a file another process writes


# -- processes -----------------------------------------------------------------------


def process_tree(pid: int) -> list[Any]:
    """``psutil.Process`` objects of ``pid`` and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_usage(pid: int) -> dict[str, int]:
    """Open fds, RSS and thread count summed over a process tree."""
    import psutil

    fds = rss = threads = procs = 0
    for p in process_tree(pid):
        try:
            fds += p.num_fds()
            rss += p.memory_info().rss
            threads += p.num_threads()
            procs += 1
        except psutil.NoSuchProcess:
            continue
    return {"fds": fds, "rss": rss, "threads": threads, "procs": procs}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def thirds(values: Sequence[float]) -> tuple[float, float]:
    """Means of the first and the last third of a series."""
    k = max(1, len(values) // 3)
    return sum(values[:k]) / k, sum(values[-k:]) / k


# -- figures -------------------------------------------------------------------------


class Figures:
    """Prints a test's figures and appends them as JSON lines to ``.results/<module>.jsonl``.

    Args:
        module: Results file stem (the test module's name).
        test: The test's node id.
        long: Whether the run is a ``--long`` one.
    """

    def __init__(self, module: str, test: str, long: bool) -> None:
        self.path = RESULTS / f"{module}.jsonl"
        self.test = test
        self.long = long

    def record(self, kind: str, **values: Any) -> None:
        """Print one line of figures and store it."""
        RESULTS.mkdir(parents=True, exist_ok=True)
        row = {"test": self.test, "kind": kind, "long": self.long, "time": round(time.time(), 3)}
        row.update(values)
        shown = " ".join(f"{k}={_short(v)}" for k, v in values.items())
        print(f"\n[figures] {self.test} {kind}: {shown}", flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) > 12:
        return f"[{len(value)} values]"
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0 for no values."""
    data = sorted(values)
    if not data:
        return 0.0
    k = min(len(data) - 1, max(0, round(q / 100 * (len(data) - 1))))
    return data[k]
