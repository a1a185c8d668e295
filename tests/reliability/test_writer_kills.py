"""Scenario 1: writers SIGKILLed at random points while a follow-mode reader watches.

A fork server (``tests/tools/kill_writer.py``) forks writer children that write
samples back to back (small and 1.5-6 MB, content encoded in the name); the test kills
each child with SIGKILL after a random delay, hundreds of times. Two writers:

* ``atomic``: this project's writer (``write_sample`` and chunked ``SampleFileWriter``):
  lock, temp file, rename, unlock;
* ``vllm``: vLLM's ``ExampleHiddenStatesConnector`` protocol, verbatim: ``open(O_TRUNC)``
  the lock, ``flock(LOCK_EX)``, ``safetensors.torch.save_file``, close the lock (with
  safetensors >= 0.8, ``save_file`` itself writes a hidden ``.tmpXXXXXX`` and renames);
* ``inplace``: the same protocol, with the bytes written straight into the final name
  (any writer without a temp file), so kills leave partial final files.

Promises checked: the reader never yields a partial or corrupt sample (every yielded
sample is compared bit for bit with what its name promises), never hangs (it ends
within its idle timeout after the last writer), yields every sample whose writer
completed it (and every complete file, reported or not); ``hidden-state verify``
reports the leftovers of killed writers (exit 1) and ``hidden-state clean`` removes
them (then verify exits 0; partial in-place files are data, which clean never deletes:
they stay reported as ``incomplete`` until removed by hand).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader, ReaderStats

from tools.relkit import (
    TOOLS,
    Figures,
    clean,
    entries,
    matches_pattern,
    pattern_tensors,
    problem_states,
    report_then_clean,
    sample_name,
    verify,
)

KILLS = {False: 150, True: 2500}  # per writer mode, default and --long
MAX_DELAY = 0.04  # seconds between fork and kill: spans several small and big samples
IDLE = 3.0
LOCK_TIMEOUT = 10.0
ORPHAN_GRACE = 1.0


class FollowChecker:
    """A follow-mode reader in a thread that checks every sample it yields."""

    def __init__(self, root: Path) -> None:
        self.reader = HiddenStateReader(
            root,
            follow=True,
            idle_timeout=IDLE,
            lock_timeout=LOCK_TIMEOUT,
            orphan_grace=ORPHAN_GRACE,
            rescan_interval=1.0,
        )
        self.yielded: list[str] = []
        self.bad: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="follow-checker")
        self.thread.start()

    def _run(self) -> None:
        try:
            for sample in self.reader:
                name = os.path.basename(sample.path)
                self.yielded.append(name)
                if not matches_pattern(sample):
                    self.bad.append(name)
        except BaseException as exc:
            self.error = exc


def run_kills(
    root: Path, mode: str, kills: int, seed: int, on_ready: Callable[[], object]
) -> dict[str, object]:
    """Fork and kill ``kills`` writers; returns what they reported.

    ``on_ready`` is called once the fork server is up (torch imported), just before the
    first writer starts, so a reader's idle timeout does not run during start-up.
    """
    rng = random.Random(seed)
    server = subprocess.Popen(
        [sys.executable, str(TOOLS / "kill_writer.py"), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    on_ready()

    def ask(line: str) -> None:
        assert server.stdin is not None
        server.stdin.write(line + "\n")
        server.stdin.flush()

    done: list[str] = []
    landed = finished = 0
    try:
        for gen in range(kills):
            ask(f"go {mode} {gen} 50 {rng.randrange(1 << 30)}")
            while True:  # the child may report a sample before the server reports it
                line = server.stdout.readline().split()
                if line[0] != "done":
                    break
                done.append(line[1])
            assert line[0] == "pid", line
            pid = int(line[1])
            time.sleep(rng.uniform(0, MAX_DELAY))  # the fault: a random moment of writing
            os.kill(pid, signal.SIGKILL)  # a zombie at worst: the server reaps on "reap"
            ask(f"reap {pid}")
            while True:
                words = server.stdout.readline().split()
                assert words, "kill_writer server died"
                if words[0] == "done":
                    done.append(words[1])
                elif words[0] == "exit":
                    status = int(words[2])
                    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                        landed += 1
                    else:
                        finished += 1
                    break
                else:
                    raise AssertionError(f"writer child said {words}")
        ask("quit")
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    return {"done": done, "landed": landed, "finished": finished}


def hidden_temps(root: Path) -> list[str]:
    """safetensors' own temporary files (``.tmpXXXXXX``): invisible to readers."""
    return [n for n in os.listdir(root) if n.startswith(".tmp")]


def _report_then_clean(
    hs_dir: Path, mode: str, yielded: set[str], done: set[str], stats: ReaderStats
) -> dict[str, int]:
    """The leftovers of the kills are reported by ``verify``, then cleaned; returns them."""
    allowed = {"stale", "orphan_temp"} | ({"incomplete"} if mode == "inplace" else set())
    problems, (rc_after, report_after) = report_then_clean(hs_dir, allowed, ready=len(yielded))
    assert problems, "hundreds of kills must leave something to report"
    skipped_by_reader = stats.stale_locks + stats.incomplete
    assert skipped_by_reader == problems.get("stale", 0) + problems.get("incomplete", 0)
    left = problem_states(report_after)
    if mode == "inplace":
        # clean never deletes data files: partial in-place files stay until removed.
        assert set(left) <= {"incomplete"}
        partial = [p["name"] for p in report_after["problems"]]
        assert not set(partial) & done
        for name in partial:
            os.unlink(hs_dir / name)
            if os.path.exists(hs_dir / (name + ".lock")):
                os.unlink(hs_dir / (name + ".lock"))
        rc_after, report_after = verify(hs_dir)
    assert rc_after == 0, report_after["problems"][:5]
    assert report_after["states"].get("ready", 0) == len(yielded)
    return problems


@pytest.mark.parametrize("mode", ["atomic", "inplace", "vllm"])
def test_killed_writers_never_yield_partial_samples(
    hs_dir: Path, mode: str, long_run: bool, figures: Figures
) -> None:
    kills = KILLS[long_run]
    started = time.monotonic()
    checkers: list[FollowChecker] = []
    outcome = run_kills(
        hs_dir, mode, kills, 1234 + long_run, lambda: checkers.append(FollowChecker(hs_dir))
    )
    checker = checkers[0]
    killed_at = time.monotonic()
    checker.thread.join(timeout=IDLE + LOCK_TIMEOUT + 30)
    ended_after = time.monotonic() - killed_at
    assert not checker.thread.is_alive(), "the follow reader must end on its idle timeout"
    assert checker.error is None, f"reader crashed: {checker.error!r}"
    done = set(outcome["done"])  # type: ignore[arg-type]

    # Never a partial or corrupt sample; every completed one yielded (exactly once).
    assert checker.bad == [], f"samples with wrong content yielded: {checker.bad[:5]}"
    counts = Counter(checker.yielded)
    assert max(counts.values(), default=1) == 1, "a follow reader yields each name once"
    yielded = set(counts)
    missing = done - yielded
    assert not missing, f"{len(missing)} completed samples never yielded: {sorted(missing)[:5]}"
    stats = checker.reader.stats
    assert stats.corrupt == 0

    # A second, snapshot reader agrees: every complete file on disk, nothing else.
    snapshot = HiddenStateReader(hs_dir, lock_timeout=LOCK_TIMEOUT, orphan_grace=0)
    again = {os.path.basename(s.path) for s in snapshot if matches_pattern(s)}
    assert again == yielded

    listing = entries(hs_dir)
    listing["hidden_tmp"] = hidden_temps(hs_dir)
    problems = _report_then_clean(hs_dir, mode, yielded, done, stats)

    figures.record(
        mode,
        hidden_safetensors_tmp_left_after_clean=len(hidden_temps(hs_dir)),
        hidden_safetensors_tmp_mib=round(
            sum(os.path.getsize(hs_dir / n) for n in hidden_temps(hs_dir)) / 2**20, 1
        ),
        kills_sent=kills,
        kills_landed=outcome["landed"],
        children_finished_before_kill=outcome["finished"],
        samples_completed_reported=len(done),
        complete_but_unreported=len(yielded - done),
        yielded=len(yielded),
        partial_or_corrupt_yielded=len(checker.bad),
        reader_skipped=stats.skipped,
        reader_stale_locks=stats.stale_locks,
        reader_incomplete=stats.incomplete,
        verify_problems=problems,
        files_before_clean={k: len(v) for k, v in listing.items()},
        reader_end_after_last_kill_s=round(ended_after, 2),
        duration_s=round(time.monotonic() - started, 1),
    )
    # Passed: give the disk back now (a --long run writes tens of GB in total).
    shutil.rmtree(hs_dir, ignore_errors=True)


def test_orphan_safetensors_temp_files_are_reported_and_cleaned(hs_dir: Path) -> None:
    """vLLM's writer calls ``safetensors.torch.save_file``, which (safetensors >= 0.8)
    writes ``.tmpXXXXXX`` next to the final name and renames it. A writer killed during
    the save leaves that file behind (the ``vllm`` mode above leaves dozens, some
    multi-MB); it must be reported and cleaned like this project's own temp files."""
    from safetensors.torch import save

    token_ids, hidden = pattern_tensors(sample_name("left", 64, 3, 1024, "f32"))
    blob = save({"hidden_states": hidden, "token_ids": token_ids})
    orphan = hs_dir / ".tmpAb3dEf"  # the name safetensors' tempfile gives it
    orphan.write_bytes(blob[: len(blob) // 2])
    lock = hs_dir / (sample_name("left", 64, 3, 1024, "f32") + ".lock")
    lock.write_bytes(b"")  # vLLM's lock, released by the kernel when the writer died
    past = time.time() - 3600
    for p in (orphan, lock):
        os.utime(p, (past, past))
    rc, report = verify(hs_dir)
    assert rc == 1
    reported = {p["name"] for p in report["problems"]}
    assert orphan.name in reported, f"only {sorted(reported)} reported; {orphan.name} is not"
    clean(hs_dir)
    assert not orphan.exists(), "hidden-state clean leaves safetensors' temp file behind"
    rc, report = verify(hs_dir)
    assert report["problems"] == [] and report["samples"] == 0
    assert rc == 0  # nothing left, nothing wrong (--require-samples would make it 1)


def test_yielded_sample_survives_an_in_place_rewrite_of_its_file(
    hs_dir: Path, figures: Figures
) -> None:
    """In-place writers (vLLM's lock protocol around a writer without a temp file, or any
    tool re-running into the same directory) truncate and rewrite a file of the same
    name. A sample the reader yielded before must keep its values, whatever happens to
    the file later."""
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "rewrite_after_read.py"), str(hs_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    outcome = {0: "intact", 3: "values changed", -signal.SIGBUS: "SIGBUS"}.get(
        proc.returncode, f"exit {proc.returncode}"
    )
    figures.record("rewrite-in-place", outcome=outcome, output=proc.stdout.strip())
    assert proc.returncode == 0, f"the yielded sample did not survive: {outcome}"
