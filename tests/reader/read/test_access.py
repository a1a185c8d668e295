"""Modes that cannot work fail before the first sample, with a typed error.

CI runs as root, which may write anywhere: the reader then runs in a child process that
drops to an unprivileged user (``nobody``, 65534) on directories that user cannot
write. Run as an ordinary user, the child keeps its user and the directories are made
read-only for it instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from samples import write_samples

NOBODY = 65534

CHILD = textwrap.dedent(
    """
    import json, os, sys
    # Everything is imported first: the interpreter's own files may not be readable by
    # the unprivileged user. The permission checks below happen after the switch.
    from hidden_state_reader import HiddenStateReader
    from hidden_state_reader.errors import DirectoryNotWritableError
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid({uid})
        os.setuid({uid})
    root, kwargs = sys.argv[1], json.loads(sys.argv[2])
    try:
        reader = HiddenStateReader(root, **kwargs)
    except DirectoryNotWritableError as exc:
        print(json.dumps({{"error": str(exc), "directory": exc.directory, "mode": exc.mode,
                          "missing": exc.missing, "is_permission_error":
                          isinstance(exc, PermissionError)}}))
    else:
        print(json.dumps({{"yielded": len(list(reader))}}))
    """
).format(uid=NOBODY)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the unprivileged child can reach (pytest's tmp_path is 0700)."""
    with tempfile.TemporaryDirectory(prefix="hs-access-") as base:
        os.chmod(base, 0o755)
        root = Path(base) / "hs"
        root.mkdir()
        write_samples(root, 2)
        yield root
        for path in (root, *root.rglob("*")):
            if path.is_dir():
                os.chmod(path, 0o755)  # let the cleanup remove what the test locked


def read_only(path: Path) -> None:
    """Make ``path`` readable but not writable for the child's user."""
    os.chmod(path, 0o555)


def run_child(root: Path, **kwargs: object) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("kwargs", "mode"),
    [
        ({"on_consumed": "delete"}, "on_consumed='delete'"),
        ({"claim": True, "follow": True, "idle_timeout": 1}, "claim=True"),
        ({"on_consumed": "move"}, "on_consumed='move'"),
    ],
    ids=["delete", "claim", "move"],
)
def test_a_mode_that_must_write_fails_before_the_first_sample(
    shared_dir: Path, kwargs: dict[str, object], mode: str
) -> None:
    read_only(shared_dir)
    out = run_child(shared_dir, **kwargs)
    assert out.get("mode") == mode, out
    assert out["directory"] == str(shared_dir)
    assert "write" in str(out["missing"])
    assert out["is_permission_error"] is True
    assert str(shared_dir) in str(out["error"]) and mode in str(out["error"])


def test_move_checks_the_done_folder_too(shared_dir: Path) -> None:
    os.chmod(shared_dir, 0o777)  # the root is writable for everyone, the done folder not
    done = shared_dir / "done"
    done.mkdir()
    read_only(done)
    out = run_child(shared_dir, on_consumed="move")
    assert out.get("directory") == str(done), out
    assert out["mode"] == "on_consumed='move'"


def test_a_plain_reader_needs_no_write_permission(shared_dir: Path) -> None:
    read_only(shared_dir)
    assert run_child(shared_dir) == {"yielded": 2}
