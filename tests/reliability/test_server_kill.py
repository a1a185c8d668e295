"""Scenario 2: ``vllm serve`` SIGKILLed mid-load while a follow-mode reader is attached.

A real server (tiny model, CPU) writes samples while client threads keep it busy with
prompts of 8-1500 tokens (some decoding a few dozen tokens, so locks stay held a
while). Once enough samples exist the whole server process group is SIGKILLed at a
random moment (``VllmServer.kill()``).

Checked: the reader ends cleanly on its idle timeout (no hang on the dead server's
locks: the kernel released them); every data file left behind is complete and valid
(the connector publishes by rename: no partial final file can exist); the reader
yielded exactly the complete files (nothing good lost); ``hidden-state verify`` reports
only stale locks and orphan temp files (exit 1), and after ``hidden-state clean``
nothing (exit 0).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hidden_state_connector.client import complete
from hidden_state_reader import HiddenStateReader, load_sample

from tools.relkit import (
    LAYERS,
    Figures,
    entries,
    held_locks,
    report_then_clean,
    serve_options,
)

pytestmark = pytest.mark.vllm

IDLE = 5.0
CLIENTS = 6
KILL_AFTER_FILES = 20


def vllm_shm_segments() -> set[str]:
    """vLLM's shared-memory message queues (``/dev/shm/psm_*``)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}
    except FileNotFoundError:
        return set()


class Load:
    """Client threads sending completions until stopped (errors after the kill are expected)."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.answered: list[dict[str, Any]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(seed + i,), daemon=True)
            for i in range(CLIENTS)
        ]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            n = rng.choice([8, 40, 200, 700, 1500])
            prompt = [rng.randrange(250) for _ in range(n)]
            try:
                result = complete(
                    self.url,
                    "tiny",
                    prompt,
                    max_tokens=rng.choice([1, 8, 48]),
                    timeout=60,
                    retries=0,
                )
            except RuntimeError:
                with self._lock:
                    self.errors += 1
                if self._stop.wait(0.2):
                    return
                continue
            with self._lock:
                self.answered.append(
                    {
                        "path": result["kv_transfer_params"]["hidden_states_path"],
                        "tokens": result["usage"]["prompt_tokens"],
                    }
                )

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=90)


class Follower:
    """A follow reader in a thread, collecting the names it yields and any error."""

    def __init__(self, out: Path) -> None:
        self.reader = HiddenStateReader(out, follow=True, idle_timeout=IDLE, lock_timeout=60)
        self.yielded: list[str] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._follow)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for sample in self.reader:
                self.yielded.append(os.path.basename(sample.path))
                assert sample.hidden_states.shape[1:] == (len(LAYERS), 128)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def test_server_killed_mid_load(
    tiny_model_bf16: Path, tmp_path: Path, start_server: Any, figures: Figures
) -> None:
    out = tmp_path / "hs"
    shm_before = vllm_shm_segments()
    server = start_server(serve_options(tiny_model_bf16, out), tmp_path / "server.log")
    rng = random.Random(7)

    follower = Follower(out)
    load = Load(server.url, seed=11)
    deadline = time.monotonic() + 240
    while len(entries(out)["data"]) < KILL_AFTER_FILES and time.monotonic() < deadline:
        time.sleep(0.2)  # watching an external process's progress
    time.sleep(rng.uniform(0, 1.5))  # the fault lands at a random moment of the load
    locks_held_at_kill = held_locks(out)
    answered_at_kill = len(load.answered)
    server.kill()
    killed = time.monotonic()
    shm_left = len(vllm_shm_segments() - shm_before)
    follower.thread.join(timeout=IDLE + 60)
    reader_end = time.monotonic() - killed
    load.stop()
    assert not follower.thread.is_alive(), "the follow reader must end on its idle timeout"
    assert not follower.errors, f"the reader crashed: {follower.errors[0]!r}"

    # Every data file is complete and valid; the reader yielded exactly those.
    listing = entries(out)
    for name in listing["data"]:
        sample = load_sample(out / name)
        assert sample.hidden_states.shape[1:] == (len(LAYERS), 128)
    assert sorted(follower.yielded) == sorted(listing["data"]), "nothing lost, nothing else"
    lengths = {os.path.basename(a["path"]): a["tokens"] for a in load.answered}
    for name in listing["data"]:
        if name in lengths:
            assert load_sample(out / name).num_tokens == lengths[name]
    answered_not_written = [n for n in lengths if n not in set(listing["data"])]

    # Leftovers: only stale locks and orphan temp files; clean removes them.
    problems, (rc_after, report_after) = report_then_clean(
        out, {"stale", "orphan_temp"}, ready=len(listing["data"])
    )
    assert rc_after == 0, report_after["problems"][:5]

    figures.record(
        "kill",
        requests_answered_before_kill=answered_at_kill,
        client_errors_after_kill=load.errors,
        locks_held_at_kill=locks_held_at_kill,
        complete_files=len(listing["data"]),
        answered_but_not_written=len(answered_not_written),
        stale_locks=problems.get("stale", 0),
        orphan_temps=problems.get("orphan_temp", 0),
        reader_yielded=len(follower.yielded),
        reader_stats=follower.reader.stats.as_dict(),
        reader_ended_after_kill_s=round(reader_end, 2),
        reader_idle_timeout_s=IDLE,
        vllm_shm_segments_left=shm_left,  # vLLM's own /dev/shm queues: no one removes them
    )
