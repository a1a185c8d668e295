"""Scenario 3: the storage root fills up under a running ``vllm serve``.

The storage root is a fresh 8 MiB tmpfs (``mount -t tmpfs``; skipped with the reason
when that is not possible, e.g. not root). Requests of 1,500 tokens make samples of
about 1.1 MiB each, so the seventh or eighth no longer fits.

Checked: every request is still answered and ``/health`` stays ok while the disk is
full; each sample that did not fit is recorded as failed (lock status ``failed`` with
the reason, or, when even the lock could not be created, a "not written" line in the
server log) and never leaves a partial final file or a temp file behind; after space is
freed (files deleted), new samples are written again.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hidden_state_connector.client import complete, complete_all
from hidden_state_reader import HiddenStateReader, load_sample
from hidden_state_reader.files.locks import SharedLock, read_status

from procs import IN_PROCESS_ENGINE
from tools.relkit import (
    HEALTH_TIMEOUT,
    TOKEN_BYTES,
    Figures,
    entries,
    held_locks,
    log_count,
    serve_options,
)

pytestmark = pytest.mark.vllm

SIZE_MB = 8
PROMPT = 1500  # tokens: 1500 x 768 B = 1.1 MiB per sample


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mount_point = tmp_path_factory.mktemp("full") / "hs"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m,mode=755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {SIZE_MB} MiB tmpfs (needs root): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture(scope="module")
def full_server(
    tiny_model_bf16: Path, small_disk: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from hidden_state_connector.apps.server import VllmServer

    log = tmp_path_factory.mktemp("full-log") / "server.log"
    options = serve_options(tiny_model_bf16, small_disk)
    server = VllmServer(options, log_file=log, env=IN_PROCESS_ENGINE)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def prompt(i: int, n: int = PROMPT) -> list[int]:
    return [(i * 37 + k * 11) % 250 for k in range(n)]


def outcome(root: Path, path: str) -> str:
    """What became of one sample: written, failed (lock says why) or failed without lock."""
    name = os.path.basename(path)
    lock = SharedLock.acquire(path, timeout=60)  # the answer comes before the write ends
    assert lock is not None, f"{name}: still locked after 60 s"
    lock.release()
    if os.path.exists(path):
        load_sample(path)  # complete and valid, or this raises
        return "written"
    lock = os.path.join(root, name + ".lock")
    if os.path.exists(lock):
        status = read_status(lock)
        assert status.failed, f"{name}: lock left without a failure status: {status}"
        return "failed:" + ("ENOSPC" if "No space" in status.reason else status.reason[:60])
    return "failed:no-lock"


def _overflow(server: Any, root: Path) -> tuple[list[Any], dict[str, str], int, list[str]]:
    """Phase 1: 14 samples of 1.1 MiB for 8 MiB. Every request is answered; each sample is
    written whole or failed (recorded in its lock, logged once), nothing half-written.

    Returns the results, each path's outcome, the log's "not written" count and reasons.
    """
    log_before = server.tail(1_000_000).count("not written")
    results = list(complete_all(server.url, "tiny", [prompt(i) for i in range(14)], concurrency=4))
    assert all(r.path for r in results), "every request is answered with its sample's path"
    assert server.healthy(timeout=HEALTH_TIMEOUT)
    outcomes = {r.path: outcome(root, r.path) for r in results if r.path}
    # A response names a failure only where the write had already failed (told in time);
    # the others learn it from the lock.
    for r in results:
        assert r.error is None or outcomes[r.path].startswith("failed"), (r.path, r.error)
    written = [p for p, o in outcomes.items() if o == "written"]
    failed = [p for p, o in outcomes.items() if o != "written"]
    assert written and failed, outcomes
    for p in written:
        assert load_sample(p).num_tokens == PROMPT
    assert entries(root)["temp"] == [], "an aborted write must remove its temp file"
    assert held_locks(root) == 0
    # The lock is released (failed) just before the log line is written.
    not_written = log_count(server, "not written", log_before + len(failed)) - log_before
    assert not_written == len(failed), "each failed sample is logged once"
    reasons = sorted(set(re.findall(r"not written \([^)]*\): (.{0,60})", server.tail(400))))
    return results, outcomes, not_written, reasons


def _while_full(server: Any, root: Path) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Phase 2: a full disk, then one without a page left; the server keeps answering.

    Returns the responses, the outcomes while full and those with no page left.
    """
    later = [
        complete(server.url, "tiny", prompt(100 + i, n)) for i, n in enumerate([4, 50, PROMPT])
    ]
    assert all(r["kv_transfer_params"]["hidden_states_path"] for r in later)
    assert server.healthy(timeout=HEALTH_TIMEOUT)
    during_full = [outcome(root, r["kv_transfer_params"]["hidden_states_path"]) for r in later]
    # Completely full (not one page left): not even the lock file can be written.
    fd = os.open(root / "filler.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, bytes(4096))
    os.close(fd)
    assert free_bytes(root) == 0
    no_room = [complete(server.url, "tiny", prompt(150 + i, 30)) for i in range(2)]
    assert server.healthy(timeout=HEALTH_TIMEOUT)
    no_room_outcomes = [
        outcome(root, r["kv_transfer_params"]["hidden_states_path"]) for r in no_room
    ]
    assert all(o.startswith("failed") for o in no_room_outcomes), no_room_outcomes
    return later + no_room, during_full, no_room_outcomes


def _remove_samples(root: Path) -> None:
    for name in os.listdir(root):
        if not name.startswith("."):
            os.unlink(root / name)


def test_full_disk_fails_samples_not_the_server(
    full_server: Any, small_disk: Path, figures: Figures
) -> None:
    root = small_disk
    results, outcomes, not_written, log_reasons = _overflow(full_server, root)
    later, during_full, no_room_outcomes = _while_full(full_server, root)

    # 3. A reader sees the written samples and skips the failed ones, each counted.
    reader = HiddenStateReader(root, orphan_grace=0)
    seen = {s.path for s in reader}
    answered = list(outcomes) + [r["kv_transfer_params"]["hidden_states_path"] for r in later]
    assert seen == {p for p in answered if os.path.exists(p)}
    assert reader.stats.corrupt == reader.stats.incomplete == 0

    # 4. Free the space: writes resume.
    free_before = free_bytes(root)
    _remove_samples(root)
    resumed = list(
        complete_all(full_server.url, "tiny", [prompt(200 + i) for i in range(4)], concurrency=2)
    )
    after = [outcome(root, r.path) for r in resumed if r.path]
    assert after == ["written"] * 4, after
    assert full_server.healthy(timeout=HEALTH_TIMEOUT)

    figures.record(
        "disk-full",
        disk_mib=SIZE_MB,
        sample_mib=round((PROMPT * TOKEN_BYTES) / 2**20, 2),
        requests=len(results),
        answered=sum(r.error is None for r in results),
        written=sum(o == "written" for o in outcomes.values()),
        failed=sum(o != "written" for o in outcomes.values()),
        failure_kinds=sorted({o for o in outcomes.values() if o != "written"}),
        server_log_not_written=not_written,
        server_log_reasons=log_reasons,
        while_full=during_full,
        no_page_left=no_room_outcomes,
        free_bytes_while_full=free_before,
        after_freeing=after,
        reader_stats={k: v for k, v in reader.stats.as_dict().items() if v},
    )
    with contextlib.suppress(OSError):
        _remove_samples(root)
