"""Write path alone: the connector's real writer vs raw sequential writes, same filesystem.

The connector's code runs exactly as in the engine's worker: ``Extractor`` gathers chunks
of a synthetic CPU "hidden-state cache" (vLLM 0.32 layout ``[blocks, layers, block_size,
hidden]``, bf16, random values) into the ``WritePipeline``'s slabs, its writer threads
stream ``SampleFileWriter`` files and publish them. A driver thread plays the engine: it
submits ``SaveJob``s (each with a held ``WriterLock``) and calls ``pump()`` every
millisecond until every job is published.

Before every timed trial an untimed write of the same size is unlinked (``_prime``): the
page allocator is warm for every writer, as on a server that writes all the time.

Baselines, interleaved with the pipeline trial by trial:

* ``raw``: one file, ``os.write`` of 16 MiB random blocks, then ``fdatasync``.
* ``raw, same files``: the same file sizes as the pipeline writes, one ``open/write/close``
  each, then ``fdatasync`` of each.

Connector rows: the defaults (``check_nonfinite`` on: the writer threads test each chunk's
raw float bits for NaN/inf with ``has_nonfinite``; ``checksum`` on: they CRC32 each chunk
as they write it), and in full mode the same with ``check_nonfinite`` off, with
``checksum`` off and with ``fsync`` on.

"Durable" rates end when the bytes are on the device (the raw file's ``fdatasync``; the
pipeline's files each ``fdatasync``-ed after publication, or ``fsync=True`` in the
connector); "page cache" rates end when the last ``write`` returned / the last file was
published.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Context,
    fmt,
    goal,
    log,
    median,
    remove_tree_contents,
    rotate,
    spread,
    table,
)

NAME = "write"
TITLE = "2. Write path alone (connector writer vs raw sequential write)"
GOAL = 0.8
RAW_BLOCK = 16 * 2**20


class _Timers:
    """Thread-safe accumulating timers: wall seconds and the thread's CPU seconds per stage."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)

    def add(self, key: str, wall: float, cpu: float) -> None:
        with self._lock:
            self.seconds[key] += wall
            self.cpu_seconds[key] += cpu

    @contextlib.contextmanager
    def timing(self, key: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t, time.thread_time() - c)

    def wrap(self, key: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.timing(key):
                return fn(*args, **kwargs)

        return wrapped


class _CrcTimer:
    """The ``crc`` a timed ``SampleFileWriter`` is given: times each call, per thread."""

    STAGE = "CRC32 of the written bytes (writer threads)"

    def __init__(self, timers: _Timers) -> None:
        self._timers = timers
        self._local = threading.local()

    def spent(self) -> tuple[float, float]:
        """Wall and CPU seconds this thread has spent in ``crc32`` so far."""
        return getattr(self._local, "spent", (0.0, 0.0))

    def crc32(self, data: Any, value: int = 0) -> int:
        from hidden_state_reader.kernels.crc import crc32

        t, c = time.perf_counter(), time.thread_time()
        try:
            return crc32(data, value)
        finally:
            wall, cpu = time.perf_counter() - t, time.thread_time() - c
            before = self.spent()
            self._local.spent = (before[0] + wall, before[1] + cpu)
            self._timers.add(self.STAGE, wall, cpu)


class _Profiling:
    """Whether a ``Variant``'s pipeline is being profiled: its timers, else None.

    The pipeline is built once with timing seams (``_timed_extractor``, ``_timed_writers``)
    that do nothing extra until ``timers`` is set for the one profiling trial.
    """

    def __init__(self) -> None:
        self.timers: _Timers | None = None
        self.crc: _CrcTimer | None = None


def _timed_extractor(profiling: _Profiling, *args: Any, **kwargs: Any) -> Any:
    """An ``Extractor`` that times its gathers and NaN/inf checks while profiling.

    Handed to ``WritePipeline`` like the production one (its documented seam).
    """
    from hidden_state_connector.engine.write.gather import Extractor

    class TimedExtractor(Extractor):
        def copy(self, *a: Any, **kw: Any) -> None:
            timers = profiling.timers
            if timers is None:
                return super().copy(*a, **kw)
            with timers.timing("gather out of the cache (engine thread)"):
                return super().copy(*a, **kw)

        def chunk_nonfinite(self, *a: Any, **kw: Any) -> bool:
            timers = profiling.timers
            if timers is None:
                return super().chunk_nonfinite(*a, **kw)
            with timers.timing("NaN/inf check (writer threads)"):
                return super().chunk_nonfinite(*a, **kw)

    return TimedExtractor(*args, **kwargs)


def _timed_writers(profiling: _Profiling) -> Any:
    """A ``WriteHooks.writer_factory``: ``SampleFileWriter``, timed per stage while profiling."""
    from hidden_state_reader.files.publish import SampleFileWriter

    def timers() -> tuple[_Timers, _CrcTimer]:
        assert profiling.timers is not None and profiling.crc is not None
        return profiling.timers, profiling.crc

    class TimedWriter(SampleFileWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            stages, crc = timers()
            with stages.timing("create file, header, token ids"):
                super().__init__(*args, crc=crc.crc32, **kwargs)

        def write_hidden(self, chunk: Any) -> None:
            stages, crc = timers()
            t, c, crc_before = time.perf_counter(), time.thread_time(), crc.spent()
            super().write_hidden(chunk)
            crc_after = crc.spent()
            stages.add(
                "write hidden states (os.write)",
                time.perf_counter() - t - (crc_after[0] - crc_before[0]),
                time.thread_time() - c - (crc_after[1] - crc_before[1]),
            )

        def publish(self) -> str:
            with timers()[0].timing("publish (rename, unlock, fsync if on)"):
                return str(super().publish())

    def factory(*args: Any, **kwargs: Any) -> SampleFileWriter:
        """Timed while profiling (the trial ends before profiling does), else plain."""
        on = profiling.timers is not None
        return (TimedWriter if on else SampleFileWriter)(*args, **kwargs)

    return factory


class Variant:
    """One connector configuration with its own pipeline (threads and slabs live across trials)."""

    def __init__(self, name: str, cache: Any, layout: Any, settings: dict[str, Any]) -> None:
        from hidden_state_connector.engine.stats import WriteStats
        from hidden_state_connector.engine.write.pipeline import WritePipeline
        from hidden_state_connector.engine.write.sample_file import WriteHooks

        self.name = name
        self.settings = settings
        self.profiling = _Profiling()
        block_bytes = layout.block_size * layout.num_layers * layout.hidden_size * 2
        self.extractor = _timed_extractor(
            self.profiling,
            cache,
            layout,
            max(1, settings["chunk_bytes"] // block_bytes),
            check_nonfinite=settings["check_nonfinite"],
        )
        self.pipeline = WritePipeline(
            self.extractor,
            num_threads=settings["num_writer_threads"],
            host_budget=settings["host_buffer_bytes"],
            when_full="wait",
            max_queued_bytes=8 * 2**30,
            checksum=settings["checksum"],
            check_nonfinite=settings["check_nonfinite"],
            fsync=settings["fsync"],
            stats=WriteStats(0),
            hooks=WriteHooks(writer_factory=_timed_writers(self.profiling)),
        )
        # Touch every slab once: a long-running server has faulted them in long ago.
        for slab in self.pipeline.pool.idle_slabs():
            slab.data.fill_(0)

    def trial(self, directory: Path, requests: list[tuple[int, list[int]]]) -> dict[str, Any]:
        """Write ``requests`` (tokens, block ids) into ``directory``; time it."""
        import torch

        from hidden_state_connector.engine.write.job import SaveJob
        from hidden_state_reader.files.locks import WriterLock
        from hidden_state_reader.format import sample_metadata

        pipeline, extractor = self.pipeline, self.extractor
        jobs = []
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i, (tokens, blocks) in enumerate(requests):
            path = str(directory / f"req-{i}.safetensors")
            token_ids = torch.arange(tokens, dtype=torch.int64) % 250
            job = SaveJob(
                req_id=f"req-{i}",
                path=path,
                token_ids=token_ids,
                block_ids=blocks,
                lock=WriterLock.create(path, request_id=f"req-{i}"),
                dir_fd=None,
                metadata=sample_metadata(
                    layer_ids=list(range(extractor.layout.num_layers)),
                    request_id=f"req-{i}",
                    num_prompt_tokens=tokens,
                    producer="benchmarks.write",
                ),
                chunks=extractor.plan(tokens),
                nbytes=tokens * extractor.token_bytes,
            )
            pipeline.submit(job)
            jobs.append(job)
        pending = list(jobs)
        while pending:
            pipeline.pump()
            pipeline.finished()
            pending = [j for j in pending if not j.finished.is_set()]
            if pending:
                time.sleep(0.001)  # the engine steps about this often, at most
        t_published, cpu = time.perf_counter(), time.process_time() - cpu0
        failed = [j.failure for j in jobs if not j.published]
        if failed:
            raise RuntimeError(f"{self.name}: {len(failed)} samples failed: {failed[:2]}")
        sizes = 0
        for job in jobs:
            fd = os.open(job.path, os.O_RDONLY)
            try:
                sizes += os.fstat(fd).st_size
                if not self.settings["fsync"]:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        t_durable = time.perf_counter()
        return {
            "bytes": sizes,
            "files": len(jobs),
            "published_s": t_published - t0,
            "durable_s": t_durable - t0,
            # Every thread of this process (the driver's gather and the writer threads):
            # what the pipeline costs the machine's cores until the last file is published.
            "cpu_s": cpu,
        }

    def profile(self, directory: Path, requests: list[tuple[int, list[int]]]) -> dict[str, Any]:
        """One more trial with timers around each stage (thread-seconds per stage)."""
        timers = _Timers()
        self.profiling.timers, self.profiling.crc = timers, _CrcTimer(timers)
        try:
            res = self.trial(directory, requests)
        finally:
            self.profiling.timers = self.profiling.crc = None
        res["thread_seconds"] = dict(timers.seconds)
        res["cpu_seconds"] = dict(timers.cpu_seconds)
        return res

    def close(self) -> None:
        self.pipeline.close(30)


def raw_trial(directory: Path, total: int, buf: memoryview) -> dict[str, Any]:
    path = directory / "raw.bin"
    t0, cpu0 = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = total
        while left:
            n = os.write(fd, buf[: min(len(buf), left)])
            left -= n
        t_written, cpu = time.perf_counter(), time.process_time() - cpu0
        os.fdatasync(fd)
    finally:
        os.close(fd)
    t_durable = time.perf_counter()
    return {
        "bytes": total,
        "published_s": t_written - t0,
        "durable_s": t_durable - t0,
        "cpu_s": cpu,
    }


def raw_files_trial(directory: Path, sizes: list[int], buf: memoryview) -> dict[str, Any]:
    t0, cpu0 = time.perf_counter(), time.process_time()
    paths = []
    for i, size in enumerate(sizes):
        path = directory / f"raw-{i}.bin"
        _write_file(path, size, buf)
        paths.append(path)
    t_written, cpu = time.perf_counter(), time.process_time() - cpu0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    t_durable = time.perf_counter()
    return {
        "bytes": sum(sizes),
        "published_s": t_written - t0,
        "durable_s": t_durable - t0,
        "cpu_s": cpu,
    }


def _prime(directory: Path, total: int, buf: memoryview) -> None:
    """Write ``total`` bytes to a file and unlink it, untimed, just before a trial.

    On a VM that hands free memory back to its host (free page reporting: this benchmark
    machine), page-cache pages freed a few seconds earlier come back at about ten times
    the CPU cost (measured: 2.4-3.4 CPU-s per GiB written after 15-30 s idle, 0.21 right
    after another write); whichever writer ran first after a pause paid it. Pages freed
    by the unlink (dirty, never written back) are what the trial allocates next, so every
    writer starts on the same, warm, page allocator, as a server writing all the time does.
    """
    path = directory / "prime.bin"
    try:
        _write_file(path, total, buf)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _write_file(path: Path, size: int, buf: memoryview) -> None:
    """Create ``path`` with ``size`` bytes, ``buf`` repeated (``os.write`` only, no sync)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            left -= os.write(fd, buf[: min(len(buf), left)])
    finally:
        os.close(fd)


def _settle(directory: Path) -> None:
    """Remove a trial's files and let the device settle (outside the timed region)."""
    remove_tree_contents(directory)
    os.sync()
    time.sleep(0.3)


def _cache_and_requests(
    cache_blocks: int, layers: int, block: int, hidden: int, tokens: int, n_requests: int
) -> tuple[Any, list[tuple[int, list[int]]]]:
    """A random bf16 paged cache and ``n_requests`` requests of random block ids (seed 0)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(
        (cache_blocks, layers, block, hidden), generator=gen, dtype=torch.float32
    ).to(torch.bfloat16)
    blocks_per_request = -(-tokens // block)
    requests = []
    for i in range(n_requests):
        ids = torch.randperm(cache_blocks, generator=gen)[:blocks_per_request].tolist()
        requests.append((tokens, ids))
        del i
    return cache, requests


def _trials(
    work: Path,
    variants: dict[str, Variant],
    names: list[str],
    requests: list[tuple[int, list[int]]],
    trials: int,
    buf: memoryview,
) -> tuple[dict[str, list[dict[str, Any]]], list[int], dict[str, Any]]:
    """Warm up, then time every writer per trial (rotating order), then profile one trial.

    Returns the trials per writer, the sizes of the files a trial writes and the profile.
    """
    n_requests = len(requests)
    per: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    # Warm-up: one untimed pass of each connector variant (threads, slabs, allocator).
    for variant in variants.values():
        res = variant.trial(work, requests[: max(2, n_requests // 4)])
        _settle(work)
    probe = variants["connector"].trial(work, requests)
    sizes = sorted(os.path.getsize(p) for p in work.glob("*.safetensors"))
    total = sum(sizes)
    _settle(work)
    log(f"write: {n_requests} files of {sizes[0] / 2**20:.1f} MiB, {total / 1e9:.2f} GB/trial")
    for t in range(trials):
        for name in rotate(names, t):
            _prime(work, total, buf)
            if name == "raw":
                res = raw_trial(work, total, buf)
            elif name == "raw, same files":
                res = raw_files_trial(work, sizes, buf)
            else:
                res = variants[name].trial(work, requests)
            per[name].append(res)
            _settle(work)
            log(
                f"write: trial {t + 1}/{trials} {name:32s} "
                f"{res['bytes'] / res['durable_s'] / 1e9:6.2f} GB/s durable, "
                f"{res['bytes'] / res['published_s'] / 1e9:6.2f} GB/s page cache"
            )
    _prime(work, total, buf)
    profile = variants["connector"].profile(work, requests)
    _settle(work)
    del probe
    return per, sizes, profile


def run(ctx: Context) -> dict[str, Any]:
    from hidden_state_connector.engine.layout import CacheLayout

    work = ctx.workdir("write")
    layers, hidden, block = 4, 4096, 16
    tokens = ctx.pick(512, 1024)
    n_requests = ctx.pick(8, 32)
    trials = ctx.pick(2, 5)
    cache_blocks = ctx.pick(64, 512)
    host_budget = ctx.pick(256 * 2**20, 2 * 2**30)
    layout = CacheLayout(token_axis=2, block_size=block, num_layers=layers, hidden_size=hidden)
    log(f"write: building a {cache_blocks * block * layers * hidden * 2 / 2**20:.0f} MiB cache")
    cache, requests = _cache_and_requests(cache_blocks, layers, block, hidden, tokens, n_requests)
    defaults = {
        "num_writer_threads": 8,
        "host_buffer_bytes": host_budget,
        "chunk_bytes": 16 * 2**20,
        "check_nonfinite": True,
        "checksum": True,
        "fsync": False,
    }
    variant_settings = {"connector": defaults}
    if not ctx.quick:
        variant_settings["connector, check_nonfinite off"] = {**defaults, "check_nonfinite": False}
        variant_settings["connector, checksum off"] = {**defaults, "checksum": False}
        variant_settings["connector, fsync on"] = {**defaults, "fsync": True}
    variants = {
        name: Variant(name, cache, layout, settings) for name, settings in variant_settings.items()
    }
    buf = memoryview(os.urandom(RAW_BLOCK))
    names = ["raw", "raw, same files", *variants]
    try:
        per, sizes, profile = _trials(work, variants, names, requests, trials, buf)
    finally:
        for variant in variants.values():
            variant.close()
        with contextlib.suppress(OSError):
            remove_tree_contents(work)
    from hidden_state_reader.kernels.crc import chosen

    res = _summarise(per, profile, variant_settings, sizes, trials, layout, tokens)
    res["crc_implementation"] = chosen()[0]
    return res


def _ratios(per: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each connector variant against raw and the faster raw, and raw's two baselines."""

    def paired(a: str, b: str, key: str) -> float:
        return median(
            [
                (x["bytes"] / x[key]) / (y["bytes"] / y[key])
                for x, y in zip(per[a], per[b], strict=False)
            ]
        )

    def vs_best_raw(name: str, key: str) -> float:
        # The faster of the two raw baselines of the same trial (the conservative choice).
        out = []
        for x, a, b in zip(per[name], per["raw"], per["raw, same files"], strict=False):
            best = max(a["bytes"] / a[key], b["bytes"] / b[key])
            out.append((x["bytes"] / x[key]) / best)
        return median(out)

    ratios = {}
    for name in per:
        if name.startswith("connector"):
            ratios[f"{name} / raw"] = {
                "durable": paired(name, "raw", "durable_s"),
                "page_cache": paired(name, "raw", "published_s"),
            }
            ratios[f"{name} / best raw"] = {
                "durable": vs_best_raw(name, "durable_s"),
                "page_cache": vs_best_raw(name, "published_s"),
            }
    ratios["raw, same files / raw"] = {
        "durable": paired("raw, same files", "raw", "durable_s"),
        "page_cache": paired("raw, same files", "raw", "published_s"),
    }
    return ratios


def _summarise(
    per: dict[str, list[dict[str, Any]]],
    profile: dict[str, Any],
    variant_settings: dict[str, dict[str, Any]],
    sizes: list[int],
    trials: int,
    layout: Any,
    tokens: int,
) -> dict[str, Any]:
    summary = {}
    for name, rows in per.items():
        summary[name] = {
            "durable_gb_s": spread([r["bytes"] / r["durable_s"] / 1e9 for r in rows]),
            "page_cache_gb_s": spread([r["bytes"] / r["published_s"] / 1e9 for r in rows]),
            "cpu_s_per_gb": spread([r["cpu_s"] / (r["bytes"] / 1e9) for r in rows]),
        }

    ratios = _ratios(per)
    headline = ratios["connector / best raw"]["durable"]
    return {
        "setup": {
            "cache_layout": "[blocks, layers, block_size, hidden] (vLLM 0.32), bf16",
            "layers": layout.num_layers,
            "hidden": layout.hidden_size,
            "block_size": layout.block_size,
            "tokens_per_request": tokens,
            "files_per_trial": len(sizes),
            "file_bytes": sizes[0] if sizes else 0,
            "bytes_per_trial": sum(sizes),
            "trials": trials,
            "variants": variant_settings,
        },
        "trials": per,
        "summary": summary,
        "ratios": ratios,
        "profile": profile,
        "goals": [
            goal(
                "write: connector / raw sequential write (faster of the two raw baselines), "
                "durable bytes/s",
                headline,
                GOAL,
            )
        ],
    }


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    ratios = res["ratios"]
    head = ratios["connector / best raw"]
    verdict = "met" if head["durable"] >= GOAL else "missed"
    summary = res["summary"]
    text = (
        f"**Write path**: the connector's pipeline sustained "
        f"{summary['connector']['durable_gb_s']['median']:.2f} GB/s to the device, "
        f"{head['durable']:.2f}\u00d7 the faster raw sequential write of the same bytes in "
        f"the same trial (one file: {summary['raw']['durable_gb_s']['median']:.2f} GB/s, the "
        f"same files: {summary['raw, same files']['durable_gb_s']['median']:.2f} GB/s); goal "
        f"\u2265 {GOAL} {verdict}. Into the page cache: {head['page_cache']:.2f}\u00d7."
    )
    secs = res["profile"].get("thread_seconds", {})
    total = sum(secs.values())
    if secs and total > 0:
        stage, top = max(secs.items(), key=lambda kv: kv[1])
        text += (
            f" Profile: {stage} takes {top / total:.0%} of the pipeline's thread time "
            f"({top / (res['profile']['bytes'] / 1e9):.1f} thread-s per GB)."
        )
    out = [text]
    cpu = {name: row["cpu_s_per_gb"]["median"] for name, row in summary.items()}
    raw_name = min(("raw", "raw, same files"), key=lambda n: cpu[n])
    raw_spread = summary[raw_name]["cpu_s_per_gb"]
    cores = os.cpu_count() or 1
    out.append(
        f"CPU per GB until in the page cache: connector {cpu['connector']:.2f} s (gather "
        f"out of the cache, NaN/inf check, CRC-32, write: the bytes are copied twice and "
        f"read twice more), raw write {cpu[raw_name]:.2f} s (one copy; "
        f"{raw_spread['min']:.2f}\u2013{raw_spread['max']:.2f} s over its trials, for the "
        f"same work: how much the kernel's page allocation varies here). With {cores} "
        f"cores that bounds the connector at about {cores / cpu['connector']:.1f} GB/s into "
        "the page cache however its threads overlap; the device's writeback shares those "
        "cores."
    )
    off = ratios.get("connector, check_nonfinite off / best raw")
    if off:
        nan_secs = secs.get("NaN/inf check (writer threads)", 0.0)
        share = f", {nan_secs / total:.0%} of the pipeline's thread time" if total > 0 else ""
        out.append(
            "The NaN/inf check (`check_nonfinite`, on by default; for a CPU cache the writer "
            "threads test the raw float bits with `has_nonfinite`, for a CUDA cache it runs on "
            "the device, not measured here): "
            f"{nan_secs / (res['profile']['bytes'] / 1e9):.2f} thread-s per GB in the "
            f"profile{share}. Durable, against "
            f"the faster raw write: with the check on {head['durable']:.2f}\u00d7, with it off "
            f"{off['durable']:.2f}\u00d7; into the page cache: {head['page_cache']:.2f}\u00d7 "
            f"on, {off['page_cache']:.2f}\u00d7 off."
        )
    crc_off = ratios.get("connector, checksum off / best raw")
    if crc_off:
        crc_secs = secs.get(_CrcTimer.STAGE, 0.0)
        share = f", {crc_secs / total:.0%} of the pipeline's thread time" if total > 0 else ""
        out.append(
            "The CRC32 (`checksum`, on by default; `kernels.crc.crc32`, here "
            f"{res.get('crc_implementation', 'zlib')}'s, over each chunk in the writer "
            "thread that writes it, the GIL released): "
            f"{crc_secs / (res['profile']['bytes'] / 1e9):.2f} thread-s per GB in the "
            f"profile{share}. Durable, against the faster raw write: with it on "
            f"{head['durable']:.2f}\u00d7, off {crc_off['durable']:.2f}\u00d7; into the page "
            f"cache: {head['page_cache']:.2f}\u00d7 on, {crc_off['page_cache']:.2f}\u00d7 off."
        )
    fsync = ratios.get("connector, fsync on / best raw")
    if fsync:
        out.append(
            f"`fsync: true` (each file made durable before its lock is released) measured "
            f"{fsync['durable']:.2f}\u00d7 the faster raw write, durable."
        )
    return out


def _rate_table(res: dict[str, Any]) -> str:
    """The main table: every writer's GB/s, durable and into the page cache, and ratios."""
    rows = []
    for name, s in res["summary"].items():
        d, p = s["durable_gb_s"], s["page_cache_gb_s"]
        ratio = res["ratios"].get(f"{name} / raw", {})
        best = res["ratios"].get(f"{name} / best raw", {})
        rows.append(
            [
                name,
                f"{fmt(d['median'])} ({fmt(d['min'])}\u2013{fmt(d['max'])})",
                f"{fmt(p['median'])} ({fmt(p['min'])}\u2013{fmt(p['max'])})",
                ratio.get("durable", 1.0 if name == "raw" else None),
                best.get("durable"),
                ratio.get("page_cache", 1.0 if name == "raw" else None),
                best.get("page_cache"),
                s["cpu_s_per_gb"]["median"],
            ]
        )
    return table(
        [
            "writer",
            "GB/s durable",
            "GB/s page cache",
            "vs raw, durable",
            "vs faster raw, durable",
            "vs raw, cache",
            "vs faster raw, cache",
            "CPU-s per GB",
        ],
        rows,
    )


def _profile_note(prof: dict[str, Any]) -> list[str]:
    """The "where the time goes" table of the instrumented trial (none without a profile)."""
    secs = prof.get("thread_seconds", {})
    cpu = prof.get("cpu_seconds", {})
    wall = prof["published_s"]
    if not secs:
        return []
    gb = prof["bytes"] / 1e9
    rows = [
        [k, v, cpu.get(k), cpu[k] / gb if k in cpu else None]
        for k, v in sorted(secs.items(), key=lambda kv: -kv[1])
    ]
    if cpu and "cpu_s" in prof:
        rest = prof["cpu_s"] - sum(cpu.values())
        rows.append(["everything else (driver loop, queues, Python)", None, rest, rest / gb])
    return [
        "",
        f"Where the time goes (one instrumented trial of the default connector: "
        f"{gb:.2f} GB published in {wall:.2f} s, {gb / wall:.2f} GB/s). Thread-seconds: "
        "wall time in each stage summed over threads (more than the wall time when "
        "threads overlap; with more threads than cores it includes waiting for a core). "
        "CPU-seconds: the threads' own CPU time in the stage (the process's total minus "
        "the stages in the last row):",
        "",
        table(["stage", "thread-seconds", "CPU-seconds", "CPU-s per GB"], rows),
    ]


def render(res: dict[str, Any]) -> str:
    setup = res["setup"]
    out = [
        f"{setup['files_per_trial']} samples of {setup['tokens_per_request']} tokens \u00d7 "
        f"{setup['layers']} layers \u00d7 {setup['hidden']} hidden (bf16; "
        f"{setup['file_bytes'] / 2**20:.1f} MiB per file, "
        f"{setup['bytes_per_trial'] / 1e9:.2f} GB per trial), gathered from a "
        f"{setup['cache_layout']} cache by `Extractor` and written by `WritePipeline` "
        "(connector defaults: 8 writer threads, 16 MiB chunks; host buffers "
        f"{setup['variants']['connector']['host_buffer_bytes'] / 2**30:g} GiB, touched "
        f"before timing). {setup['trials']} trials per row, interleaved; medians (min\u2013max). "
        "Before each trial the same number of bytes is written to a file that is then "
        "unlinked, untimed: on this VM page-cache pages freed seconds earlier go back to "
        "the host and cost about ten times the CPU to allocate again (2.4\u20133.4 against "
        "0.21 CPU-s per GiB), which otherwise fell on whichever writer came first.",
        "",
    ]
    out.append(_rate_table(res))
    out += [
        "",
        '"vs faster raw": against the faster of the two raw baselines in the same trial '
        '(the goal\'s measure). Ratios are medians of per-trial ratios. "CPU-s per GB": '
        "CPU time of the whole benchmark process (every thread: the connector's gather on "
        "the driver thread and its writer threads) until the last byte was in the page "
        "cache, per GB written; the kernel's writeback threads are not in it, for any row.",
    ]
    out += _profile_note(res["profile"])
    return "\n".join(out)
