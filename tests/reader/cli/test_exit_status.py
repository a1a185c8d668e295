"""The exit status of ``verify`` and ``stats`` on a directory without samples.

A live directory that a deleting consumer has emptied is healthy: 0. A job that must have
produced something asks with ``--require-samples``; a directory whose samples are all in
sub-folders is the wrong one. Each command's ``--help`` states the rule.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from samples import write_samples

CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]
CONSUMER = """
import sys
from hidden_state_reader import HiddenStateReader
print(sum(1 for _ in HiddenStateReader(sys.argv[1], on_consumed="delete")))
"""


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_directory_a_deleting_consumer_emptied_is_healthy(hs_dir: Path) -> None:
    write_samples(hs_dir, 3)
    assert run("verify", hs_dir).returncode == 0
    consumer = subprocess.run(
        [sys.executable, "-c", CONSUMER, str(hs_dir)], capture_output=True, text=True, timeout=120
    )
    assert consumer.stdout.strip() == "3", consumer.stderr
    assert not list(hs_dir.glob("*.safetensors*"))

    for command in ("verify", "stats"):
        proc = run(command, hs_dir)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        assert f"no samples (*.safetensors) found in {hs_dir}: it is empty" in proc.stderr
        required = run(command, hs_dir, "--require-samples")
        assert required.returncode == 1, (command, required.stdout)
    report = json.loads(run("verify", hs_dir, "--json").stdout)
    assert report["ok"] is True and report["samples"] == 0


def test_samples_only_in_sub_folders_is_the_wrong_directory(tmp_path: Path) -> None:
    (tmp_path / "run1").mkdir()
    write_samples(tmp_path / "run1", 2)
    for command in ("verify", "stats"):
        proc = run(command, tmp_path)
        assert proc.returncode == 1, (command, proc.stdout)
        assert "samples are in sub-folders (run1)" in proc.stderr
    assert run("verify", tmp_path / "run1").returncode == 0


def test_stats_fails_when_nothing_here_can_be_trained_on(hs_dir: Path) -> None:
    (hs_dir / "garbage.safetensors").write_bytes(bytes(range(256)))
    proc = run("stats", hs_dir)
    assert proc.returncode == 1
    assert "1 corrupt" in proc.stdout


def test_help_states_the_exit_status_contract() -> None:
    for command in ("verify", "stats"):
        text = " ".join(run(command, "--help").stdout.split())
        assert "exit status: 0 " in text
        assert "A directory without samples exits 0" in text
        assert "--require-samples" in text
