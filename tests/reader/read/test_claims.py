"""Exactly-once delivery across reader processes sharing one directory."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from procs import WRITER, start_together
from samples import write_samples

TOOLS = Path(__file__).resolve().parents[2] / "tools"
READER = [sys.executable, str(TOOLS / "claim_reader.py")]


def start_reader(root: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*READER, str(root), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("delete", [False, True], ids=["keep", "delete"])
def test_four_processes_consume_1000_samples_exactly_once(hs_dir: Path, delete: bool) -> None:
    # 1,000 samples per mode here; tests/reliability/test_many_readers.py runs 4,000 with
    # readers killed at random (50,000 with --long).
    extra = ["--delete"] if delete else []
    # Every process is loaded (imports take seconds on a loaded machine) before the first
    # sample exists: a reader still starting when the others have drained everything would
    # rightly get nothing, and readers waiting on a slow writer would reach their idle timeout.
    writer = subprocess.Popen(
        [*WRITER, "stream", str(hs_dir), "1000", "go"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    readers = [start_reader(hs_dir, "--ready", *extra) for _ in range(4)]
    start_together([(writer, "loaded"), *((r, "ready") for r in readers)])
    assert writer.wait(timeout=300) == 0
    outputs = [r.communicate(timeout=300) for r in readers]
    assert [r.returncode for r in readers] == [0, 0, 0, 0], [e[-3000:] for _, e in outputs]
    names = [line for out, _ in outputs for line in out.split()]
    counts = Counter(names)
    assert len(counts) == 1000, "no sample lost"
    assert max(counts.values()) == 1, "no sample consumed twice"
    assert all(out.split() for out, _ in outputs), "every reader took a share"
    stats = [ast.literal_eval(err.split("stats ", 1)[1].strip()) for _, err in outputs]
    assert sum(s["yielded"] for s in stats) == 1000
    assert all(s["incomplete"] == s["corrupt"] == s["failed"] == 0 for s in stats)


def test_a_dead_readers_claim_is_taken_over(hs_dir: Path) -> None:
    write_samples(hs_dir, 3)
    holder = start_reader(hs_dir, "--hold-first", "--idle", "60")
    assert holder.stdout is not None
    held = holder.stdout.readline().split()[1]
    survivor = start_reader(hs_dir, "--idle", "4")
    holder.send_signal(signal.SIGKILL)  # dies holding the claim; the kernel frees its lock
    holder.wait()
    out, err = survivor.communicate(timeout=60)
    assert survivor.returncode == 0
    assert sorted(out.split()) == [f"hs_{i}.safetensors" for i in range(3)]
    assert held in out.split()
    stats = ast.literal_eval(err.split("stats ", 1)[1].strip())
    assert stats["reclaimed"] == 1


def test_consumer_groups_each_see_every_sample(hs_dir: Path) -> None:
    from hidden_state_reader import HiddenStateReader

    write_samples(hs_dir, 5)
    a = list(HiddenStateReader(hs_dir, claim=True, claim_group="job-a"))
    b = list(HiddenStateReader(hs_dir, claim=True, claim_group="job-b"))
    again = list(HiddenStateReader(hs_dir, claim=True, claim_group="job-a"))
    assert len(a) == 5 and len(b) == 5 and again == []


def test_ctrl_c_while_recording_a_delivered_sample_still_records_it(
    hs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C can land between any two bytecodes; here, inside the consumed-record step."""
    from hidden_state_reader import HiddenStateReader
    from hidden_state_reader.read import directory as directory_backend

    write_samples(hs_dir, 2)
    real_dispose = directory_backend.dispose
    calls = []

    def interrupted_once(*args: object) -> bool:
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the fault: a signal mid-commit
        return real_dispose(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(directory_backend, "dispose", interrupted_once)
    reader = HiddenStateReader(hs_dir, claim=True, claim_group="g")
    samples = iter(reader)
    first = next(samples)
    with pytest.raises(KeyboardInterrupt):
        next(samples)  # resumes the generator: it records `first`, and Ctrl-C lands
    reader.close()
    monkeypatch.setattr(directory_backend, "dispose", real_dispose)
    claim = hs_dir / ".claims" / "g" / "hs_0.safetensors.claim"
    assert json.loads(claim.read_text())["state"] == "done"
    # A second reader of the group gets only the other sample: the first stays consumed.
    rest = [s.path for s in HiddenStateReader(hs_dir, claim=True, claim_group="g")]
    assert [Path(p).name for p in rest] == ["hs_1.safetensors"]
    assert Path(first.path).name == "hs_0.safetensors"


def test_a_claiming_follow_dataset_resumes_from_its_claims(hs_dir: Path) -> None:
    """Follow mode has no order to resume in: the claims say what was consumed.

    The sample the loop held when it stopped was given back (docs/reader.md, "What does
    a crash lose?"), so the resumed run delivers it again, and every other sample once.
    """
    from hidden_state_reader.training.dataset import HiddenStateDataset

    write_samples(hs_dir, 9)

    def make() -> HiddenStateDataset:
        return HiddenStateDataset(hs_dir, follow=True, idle_timeout=0.5, claim_group="run")

    first = make()
    passing = iter(first)
    before = [os.path.basename(next(passing).path) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))
    passing.close()  # holding the 4th
    assert state["mode"] == "follow" and state["consumed"] == 4

    resumed = make()
    resumed.load_state_dict(state)
    after = [os.path.basename(s.path) for s in resumed]
    assert Counter(before[:3] + after) == Counter(f"hs_{i}.safetensors" for i in range(9))
    assert before[3] in after
    assert resumed.consumed == 4 + len(after)


def _group(
    hs_dir: Path, count: int, *reader_args: list[str], written_first: bool = False
) -> list[tuple[list[str], dict]]:
    """Readers with ``reader_args`` each and a writer of ``count`` samples, started
    together (``written_first``: the samples are all written before the readers start);
    each reader's names and stats."""
    writer = None
    if written_first:  # what the writer process would write
        write_samples(hs_dir, count, tokens=4, layers=1, hidden=8, dtype=torch.float32)
    else:
        stream = [*WRITER, "stream", str(hs_dir), str(count), "go"]
        writer = subprocess.Popen(stream, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    readers = [start_reader(hs_dir, "--ready", *args) for args in reader_args]
    loaded = [] if writer is None else [(writer, "loaded")]
    start_together([*loaded, *((r, "ready") for r in readers)])
    assert writer is None or writer.wait(timeout=300) == 0
    outputs = [r.communicate(timeout=300) for r in readers]
    assert [r.returncode for r in readers] == [0] * len(readers), [e for _, e in outputs]
    return [
        (out.split(), ast.literal_eval(err.split("stats ", 1)[1].strip())) for out, err in outputs
    ]


def _exactly_once(results: list[tuple[list[str], dict]], count: int) -> None:
    counts = Counter(name for names, _ in results for name in names)
    assert sorted(counts) == sorted(f"hs_{i}.safetensors" for i in range(count)), "none lost"
    assert max(counts.values()) == 1, "none twice"


def test_eight_readers_try_each_sample_about_once(hs_dir: Path) -> None:
    # Ownership: each sample's owner claims it; the others leave it to the owner (they
    # look once, with a stat, when their turn comes) instead of all racing for the claim.
    results = _group(hs_dir, 800, *[["--delete", "--idle", "4"]] * 8)
    _exactly_once(results, 800)
    failed = sum(s["claimed_elsewhere"] + s["done_elsewhere"] + s["vanished"] for _, s in results)
    # Before ownership every reader tried every sample: about 7 failed attempts per sample
    # with 8 readers. Left: members joining (their lists differ for a moment) and steals.
    assert failed / 800 < 1.0, [s for _, s in results]
    assert all(names for names, _ in results), "every reader took a share"


def test_a_reader_leaving_mid_stream_strands_nothing(hs_dir: Path) -> None:
    results = _group(hs_dir, 400, ["--delete", "--max", "10"], *[["--delete", "--idle", "4"]] * 2)
    assert len(results[0][0]) == 10  # it left after ten; its share went to the others
    _exactly_once(results, 400)


def test_a_member_that_stops_reading_keeps_only_what_it_holds(hs_dir: Path) -> None:
    # A live member that takes one sample and then never asks for another (a stuck
    # training step) still owns a share of what comes later: stand-ins take it after
    # claim_steal_after. Only the sample it holds stays with it (its claim is live).
    holder = start_reader(hs_dir, "--hold-first", "--idle", "60", "--steal", "0.5")
    write_samples(hs_dir, 1)
    assert holder.stdout is not None
    held = holder.stdout.readline().split()[1]
    try:
        write_samples(hs_dir, 60, start=1)
        out, err = start_reader(hs_dir, "--idle", "4", "--steal", "0.5").communicate(timeout=120)
        expected = {f"hs_{i}.safetensors" for i in range(61)} - {held}
        assert sorted(out.split()) == sorted(expected), err[-2000:]
    finally:
        holder.kill()
        holder.wait()


def test_a_slow_member_shares_its_backlog_with_a_fast_one(hs_dir: Path) -> None:
    # DDP ranks of different speeds: the slow one's samples left unclaimed past
    # claim_steal_after go to the fast one, so neither starves nor sits on a backlog.
    # The backlog is there before either reads (issue 42): streamed by a writer that a
    # busy machine slowed to the slow member's pace, there was none, and the slow member
    # rightly kept its half (the fast one took no more than it, 1 run in 9).
    slow, fast = _group(hs_dir, 200, ["--work-ms", "100", "--steal", "0.5", "--idle", "4"],
                        ["--steal", "0.5", "--idle", "4"], written_first=True)  # fmt: skip
    _exactly_once([slow, fast], 200)
    assert slow[0], "the slow member still took a share"
    assert len(fast[0]) > len(slow[0]), (len(fast[0]), len(slow[0]))


@pytest.mark.parametrize("folder", ["group", "all claims"])
def test_a_group_reset_while_following_goes_on_reading(hs_dir: Path, folder: str) -> None:
    """Deleting a group's claims folder resets it (docs/operations.md), also mid-stream.

    The claim of the next sample was then created in a folder that no longer existed:
    ``FileNotFoundError`` escaped from iteration. The reader makes the folder again.
    """
    from hidden_state_reader import HiddenStateReader

    write_samples(hs_dir, 2)
    reader = HiddenStateReader(hs_dir, follow=True, claim=True, claim_group="g",
                               idle_timeout=30, max_samples=2)  # fmt: skip
    got = []
    for sample in reader:
        got.append(Path(sample.path).name)
        if len(got) == 1:
            # The fault: the folder is removed by hand while the reader holds a claim.
            shutil.rmtree(hs_dir / ".claims" / ("g" if folder == "group" else ""))
    assert sorted(got) == ["hs_0.safetensors", "hs_1.safetensors"]
    claim = hs_dir / ".claims" / "g" / f"{got[1]}.claim"
    assert json.loads(claim.read_text())["state"] == "done"
    assert reader.stats.yielded == 2


def test_a_claim_whose_temporary_file_vanished_is_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``link`` finds the temporary file gone (removed by another process): try again."""
    from hidden_state_reader.read.claims import ClaimResult, ClaimStore

    store = ClaimStore(str(tmp_path))
    real_link = os.link
    links = []

    def link_after_removal(src: str, dst: str) -> None:
        links.append(src)
        if len(links) == 1:
            os.unlink(src)  # the fault, at the exact moment
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link_after_removal)
    claim = store.try_claim("s.safetensors")
    monkeypatch.setattr(os, "link", real_link)
    assert len(links) == 2 and links[0] != links[1]
    assert not isinstance(claim, ClaimResult) and claim.fd is not None
    assert ClaimStore(str(tmp_path)).try_claim("s.safetensors") is ClaimResult.HELD
    assert os.listdir(store.directory) == ["s.safetensors.claim"]  # no temporary left
    claim.done()
    assert store.is_done("s.safetensors")


def test_a_storage_root_removed_is_never_made_again(tmp_path: Path) -> None:
    """Only folders below the storage root are made again: claims under a root that was
    removed (or a mount point left empty) would be claims no other reader sees."""
    from hidden_state_reader.read.claims import ClaimStore

    root = tmp_path / "hs"
    root.mkdir()
    store = ClaimStore(str(root))
    shutil.rmtree(root)
    with pytest.raises(FileNotFoundError):
        store.try_claim("s.safetensors")
    assert not root.exists()


def test_a_claim_whose_temporary_name_cannot_be_removed_is_not_left_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linked, then the temporary name's removal fails: the error reaches the caller and
    the new claim is not held by a descriptor nobody has (another reader takes it over)."""
    from hidden_state_reader.read.claims import ClaimResult, ClaimStore

    store = ClaimStore(str(tmp_path))
    real_unlink = os.unlink

    def refuse_temporary(path: str, *args: object, **kwargs: object) -> None:
        if ".tmp." in os.path.basename(path):
            raise PermissionError(13, "injected", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", refuse_temporary)
    with pytest.raises(PermissionError):
        store.try_claim("s.safetensors")
    monkeypatch.setattr(os, "unlink", real_unlink)
    taken = ClaimStore(str(tmp_path)).try_claim("s.safetensors")
    assert not isinstance(taken, ClaimResult), taken  # unlocked: taken over
