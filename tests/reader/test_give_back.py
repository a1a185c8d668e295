"""A loop that stops early gives back the sample it holds.

docs/reader.md, "What does a crash lose?":

``for sample in HiddenStateReader(...)``: the sample the loop holds is consumed
(``on_consumed``, its claim settled) when the loop asks for the next one, or at
``reader.commit()``. A ``break`` or an exception in the loop's body gives it back: not
deleted, not moved, its claim released so that another reader of the group gets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader

from samples import write_samples

CLAIM_READER = Path(__file__).resolve().parents[1] / "tools" / "claim_reader.py"
NAMES = [f"hs_{i}.safetensors" for i in range(5)]


class StepError(Exception):
    """What the loop's body raises (a bug in the user's training step)."""


def in_root(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors"))


def moved(done: Path) -> list[str]:
    return sorted(p.name for p in done.glob("*.safetensors")) if done.is_dir() else []


def open_reader(root: Path, mode: str, *, follow: bool, claim: bool) -> HiddenStateReader:
    extra = {"follow": True, "idle_timeout": 1.0} if follow else {}
    return HiddenStateReader(root, on_consumed=mode, claim=claim, **extra)  # type: ignore[arg-type]


def stop_at_second(reader: HiddenStateReader, how: str, commit: bool = False) -> list[str]:
    """Iterate; stop (break or raise) while holding the second sample. Names seen."""
    seen = []
    if how == "raise":
        with pytest.raises(StepError):
            for sample in reader:
                seen.append(os.path.basename(sample.path))
                if len(seen) == 2:
                    if commit:
                        reader.commit()
                    raise StepError
    else:
        for sample in reader:
            seen.append(os.path.basename(sample.path))
            if len(seen) == 2:
                if commit:
                    reader.commit()
                break
    return seen


@pytest.mark.parametrize("claim", [False, True], ids=["no-claim", "claim"])
@pytest.mark.parametrize("follow", [False, True], ids=["static", "follow"])
@pytest.mark.parametrize("mode", ["delete", "move"])
@pytest.mark.parametrize("how", ["break", "raise"])
def test_a_loop_that_stops_keeps_the_sample_it_holds(
    hs_dir: Path, how: str, mode: str, follow: bool, claim: bool
) -> None:
    write_samples(hs_dir, 5)
    done = hs_dir / "done"
    first = open_reader(hs_dir, mode, follow=follow, claim=claim)
    seen = stop_at_second(first, how)
    assert seen == NAMES[:2]
    # The first was consumed (the loop asked for the next); the held second was not.
    assert in_root(hs_dir) == NAMES[1:]
    assert moved(done) == (NAMES[:1] if mode == "move" else [])
    assert (hs_dir / (NAMES[1] + ".lock")).exists()
    # Its claim is released: another reader of the group gets it, while ``first`` (not
    # closed, still referenced) lives on.
    second = open_reader(hs_dir, mode, follow=follow, claim=claim)
    assert sorted(os.path.basename(s.path) for s in second) == NAMES[1:]
    assert second.stats.claimed_elsewhere == 0 and second.stats.done_elsewhere == 0
    assert in_root(hs_dir) == []
    assert moved(done) == (NAMES if mode == "move" else [])
    first.close()


@pytest.mark.parametrize("how", ["break", "raise"])
@pytest.mark.parametrize(
    ("mode", "follow", "claim"), [("delete", False, True), ("move", True, False)]
)
def test_commit_records_the_held_sample_before_the_loop_stops(
    hs_dir: Path, how: str, mode: str, follow: bool, claim: bool
) -> None:
    write_samples(hs_dir, 5)
    reader = open_reader(hs_dir, mode, follow=follow, claim=claim)
    assert stop_at_second(reader, how, commit=True) == NAMES[:2]
    assert in_root(hs_dir) == NAMES[2:]
    assert moved(hs_dir / "done") == (NAMES[:2] if mode == "move" else [])
    rest = open_reader(hs_dir, mode, follow=follow, claim=claim)
    assert [os.path.basename(s.path) for s in rest] == NAMES[2:]
    assert rest.stats.done_elsewhere == 0


def test_commit_with_nothing_held_does_nothing_and_a_full_loop_consumes_all(hs_dir: Path) -> None:
    write_samples(hs_dir, 5)
    reader = HiddenStateReader(hs_dir, on_consumed="delete", claim=True)
    reader.commit()
    seen = []
    for sample in reader:
        seen.append(os.path.basename(sample.path))
        if len(seen) == 2:
            reader.commit()  # at once; the loop goes on and records nothing twice
            assert in_root(hs_dir) == NAMES[2:]
    reader.commit()
    assert seen == NAMES and in_root(hs_dir) == []
    assert reader.stats.yielded == 5


def test_leaving_the_with_block_gives_back_what_an_open_iterator_holds(hs_dir: Path) -> None:
    """An iterator kept in a variable is not closed by the loop: ``with`` exit gives back."""
    write_samples(hs_dir, 5)
    samples: Iterator[object]
    with HiddenStateReader(hs_dir, on_consumed="delete", claim=True) as reader:
        samples = iter(reader)
        next(samples)
        next(samples)  # the first is consumed now; the second is held
    assert in_root(hs_dir) == NAMES[1:]
    assert list(samples) == []  # the reader is closed: nothing more, nothing recorded
    assert in_root(hs_dir) == NAMES[1:]
    with HiddenStateReader(hs_dir, on_consumed="delete", claim=True) as again:
        assert [os.path.basename(s.path) for s in again] == NAMES[1:]


def test_a_break_releases_the_claim_to_a_reader_in_another_process(hs_dir: Path) -> None:
    write_samples(hs_dir, 5)
    reader = HiddenStateReader(hs_dir, follow=True, idle_timeout=1.0, claim=True,
                               on_consumed="delete")  # fmt: skip
    assert stop_at_second(reader, "break") == NAMES[:2]
    proc = subprocess.run(
        [sys.executable, str(CLAIM_READER), str(hs_dir), "--delete", "--idle", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == NAMES[1:]
    assert in_root(hs_dir) == []
    reader.close()
