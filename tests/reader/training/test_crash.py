"""A trainer killed mid-run loses no sample: what it read ahead goes to the next trainer.

Issue 29: DataLoader workers (and the device feed's builder threads) read batches ahead
of the training loop; a sample is deleted only once the loop is past its batch, so a
SIGKILLed trainer leaves everything it had not trained claimed by a dead process, and
another trainer of the group takes it over. At most the batch in flight is trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_reader.read.claims import Claim, ClaimResult, ClaimStore
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import write_samples

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

TRAINER = [sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "paced_trainer.py")]
COUNT = 80
STEPS = 5  # batches the first trainer gets; it is killed holding the last of them


def steps_of_a_trainer_killed_holding_a_batch(root: Path, how: str) -> list[list[str]]:
    """Run ``paced_trainer.py`` for ``STEPS`` batches, check, SIGKILL it; its batches."""
    trainer = subprocess.Popen([*TRAINER, str(root), how], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        assert trainer.stdout.readline().strip() == "ready"
        trained: list[list[str]] = []
        for step in range(STEPS):
            if step:
                trainer.stdin.write("next\n")  # past the batch before: it is acknowledged
            trainer.stdin.write("go\n" if not step else "")
            trainer.stdin.flush()
            trained.append(json.loads(trainer.stdout.readline()))
        # The loop was past every batch but the one it holds: those are deleted, the one
        # in flight and everything read ahead are not.
        assert not any((root / name).exists() for batch in trained[:-1] for name in batch)
        assert all((root / name).exists() for name in trained[-1])
        left = [p for p in root.iterdir() if p.name.endswith(".safetensors")]
        assert len(left) == COUNT - 4 * (STEPS - 1)
        os.kill(trainer.pid, signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    return trained


@pytest.mark.parametrize("how", ["workers", "cpu"])
def test_a_killed_trainer_loses_no_sample(hs_dir: Path, how: str) -> None:
    write_samples(hs_dir, COUNT, tokens=2)
    killed = steps_of_a_trainer_killed_holding_a_batch(hs_dir, how)
    device = {"device": "cpu"} if how == "cpu" else {}
    survivor = HiddenStateLoader(
        HiddenStateDataset(hs_dir, follow=True, on_consumed="delete", idle_timeout=1.5),
        batch_size=4,
        num_workers=2,
        **device,
    )
    trained = [os.path.basename(path) for batch in survivor for path in batch["paths"]]
    by_killed = [name for batch in killed for name in batch]
    assert sorted(set(by_killed) | set(trained)) == sorted(
        f"hs_{i}.safetensors" for i in range(COUNT)
    )
    assert len(trained) == len(set(trained))
    assert set(by_killed) & set(trained) == set(killed[-1])  # the batch in flight, again
    assert not [p for p in hs_dir.iterdir() if p.name.endswith(".safetensors")]


def batch_names(batch: dict) -> list[str]:
    return [os.path.basename(path) for path in batch["paths"]]


@pytest.mark.parametrize(
    "loader_kw",
    [
        {"num_workers": 0},
        {"num_workers": 2},
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 2, "device": "cpu"},
    ],
    ids=["in-process", "workers", "persistent-workers", "threads"],
)
def test_commit_records_the_batch_held_and_a_break_gives_it_back(
    hs_dir: Path, loader_kw: dict
) -> None:
    write_samples(hs_dir, 24, tokens=2)
    ds = HiddenStateDataset(hs_dir, follow=True, on_consumed="delete", idle_timeout=1.0)
    loader = HiddenStateLoader(ds, batch_size=4, **loader_kw)
    batches = iter(loader)
    committed = batch_names(next(batches))
    loader.commit()  # e.g. at a checkpoint: the loop is done with this batch
    assert not any((hs_dir / name).exists() for name in committed)
    held = batch_names(next(batches))
    del batches  # the loop stops holding a batch it did not finish
    assert all((hs_dir / name).exists() for name in held)
    rest = [name for batch in loader for name in batch_names(batch)]
    assert set(held) <= set(rest)  # delivered again, with what was read ahead
    assert sorted(committed + rest) == sorted(f"hs_{i}.safetensors" for i in range(24))
    assert not [p for p in hs_dir.iterdir() if p.name.endswith(".safetensors")]


def test_a_break_gives_back_at_once_what_a_persistent_worker_holds(hs_dir: Path) -> None:
    """A persistent worker outlives the pass: it gives back at the break, not when it next reads.

    It gave back only when the loader was iterated again, so meanwhile another consumer of
    the group (or a sibling worker's reader of the next pass, issue 42) found the batch
    claimed by a live process. Eight samples, two batches: the worker has read every one
    before the second batch arrives, so nothing is still being claimed at the break.
    """
    write_samples(hs_dir, 8, tokens=2)
    ds = HiddenStateDataset(hs_dir, follow=True, on_consumed="delete", idle_timeout=1.0)
    loader = HiddenStateLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)
    batches = iter(loader)
    committed = batch_names(next(batches))
    loader.commit()
    held = batch_names(next(batches))
    del batches  # the break
    others = ClaimStore(str(hs_dir))  # another consumer of the group, right now
    taken = {name: others.try_claim(name) for name in held}
    assert not [name for name, claim in taken.items() if isinstance(claim, ClaimResult)], taken
    for claim in taken.values():
        assert isinstance(claim, Claim)
        claim.abandon()
    rest = [name for batch in loader for name in batch_names(batch)]
    assert sorted(rest) == sorted(held)  # and the loader's next pass delivers it again
    assert sorted(committed + rest) == sorted(f"hs_{i}.safetensors" for i in range(8))


def test_static_delete_removes_a_batch_once_the_loop_is_past_it(hs_dir: Path) -> None:
    write_samples(hs_dir, 16, tokens=2)
    loader = HiddenStateLoader(
        HiddenStateDataset(hs_dir, on_consumed="delete"), batch_size=4, num_workers=2
    )
    seen: list[list[str]] = []
    for batch in loader:
        seen.append(batch_names(batch))
        assert not any((hs_dir / n).exists() for names in seen[:-1] for n in names)
        assert all((hs_dir / name).exists() for name in seen[-1])
    assert len(seen) == 4 and not [p for p in hs_dir.iterdir() if p.suffix == ".safetensors"]


@pytest.mark.parametrize("persistent", [False, True])
def test_claims_settled_by_the_training_process_stay_done(hs_dir: Path, persistent: bool) -> None:
    """Workers let go of claims the training process marked done: none is given back."""
    write_samples(hs_dir, 12, tokens=2)
    ds = HiddenStateDataset(hs_dir, follow=True, idle_timeout=0.5)  # on_consumed="keep"
    loader = HiddenStateLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    first = [name for batch in loader for name in batch_names(batch)]
    assert sorted(first) == sorted(f"hs_{i}.safetensors" for i in range(12))
    again = [name for batch in loader for name in batch_names(batch)]  # workers exited
    assert again == []
    claims = sorted((hs_dir / ".claims" / "default").glob("*.claim"))
    assert len(claims) == 12
    assert all(json.loads(claim.read_text())["state"] == "done" for claim in claims)
