"""``engine/storage_check.py``: the storage root's start-up check, and client-chosen directories.

Real files, real mounts and separate processes: CI runs as root, where permission bits
do not stop writes, so "cannot write" is made real by a read-only bind mount (in a
private mount namespace, ``unshare -m``), by a child process that drops to uid 65534, or
by a path whose parent is a regular file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hidden_state_connector.engine.storage_check import (
    PROBE_STEM,
    DirectoryProbeCache,
    StorageRootError,
    check_storage_root,
    probe,
    usable_directory,
)
from hidden_state_reader.format import DATA_SUFFIX, Kind, classify, temp_path

NOBODY = 65534


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        script = f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d} && ! touch {d}/x"
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script], capture_output=True, check=False
        )
        return done.returncode == 0 and not os.path.exists(os.path.join(d, "x"))


UNSHARE = _unshare_works()


def run_in_read_only_mount(directory: Path, code: str) -> dict:
    """Run ``code`` (prints one JSON line) as root with ``directory`` bind-mounted read-only.

    The mount lives in a private mount namespace: nothing outside the child sees it, and
    it goes away with the child whatever happens.
    """
    quoted = str(directory)
    script = (
        f"mount --bind '{quoted}' '{quoted}' && mount -o remount,ro,bind '{quoted}' '{quoted}' "
        f'&& exec "$0" -c "$1"'
    )
    return _last_json_line(["unshare", "-m", "sh", "-c", script, sys.executable, code])


def run_unprivileged(code: str) -> dict:
    """Run ``code`` (prints one JSON line) in a child that drops to uid/gid 65534 first.

    The child imports what ``code`` needs as root (the interpreter may live where nobody
    cannot read), then gives up root before running it.
    """
    prelude = textwrap.dedent(
        f"""
        import json, os
        import hidden_state_connector.engine.storage_check
        os.setgroups([])
        os.setgid({NOBODY})
        os.setuid({NOBODY})
        """
    )
    return _last_json_line([sys.executable, "-c", prelude + code])


def _last_json_line(cmd: list[str]) -> dict:
    """Run ``cmd``; it must succeed, and its last line of output is the JSON result."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


CHECK_ROOT = textwrap.dedent(
    """
    import json, sys
    from hidden_state_connector.engine.storage_check import StorageRootError, check_storage_root
    try:
        check_storage_root({path!r})
        print(json.dumps({{"error": None}}))
    except StorageRootError as exc:
        print(json.dumps({{"error": str(exc), "reason": exc.reason}}))
    """
)

ASK_DIRECTORY = textwrap.dedent(
    """
    import json
    from hidden_state_connector.engine.storage_check import usable_directory
    print(json.dumps({{"reason": usable_directory({path!r})}}))
    """
)


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory outside pytest's private (0700) tmp tree, traversable by anyone."""
    d = Path(tempfile.mkdtemp(prefix="hs-startup-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- the probe ------------------------------------------------------------------------


def test_probe_of_a_writable_directory_succeeds_and_leaves_nothing(hs_dir: Path) -> None:
    (hs_dir / "a.safetensors").write_bytes(b"keep")
    assert probe(str(hs_dir)) is None
    assert sorted(p.name for p in hs_dir.iterdir()) == ["a.safetensors"]


def test_probe_files_are_temporaries_that_readers_ignore() -> None:
    name = os.path.basename(temp_path(PROBE_STEM + DATA_SUFFIX))
    assert classify(name) is Kind.TEMP


def test_probe_reports_the_step_and_removes_its_file_when_flock_fails(
    hs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A filesystem without flock (some NFS/FUSE mounts) cannot be produced here: inject.
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    reason = probe(str(hs_dir))
    assert reason is not None
    assert reason.startswith("cannot flock a file in it") and "No locks available" in reason
    assert list(hs_dir.iterdir()) == []


# -- start-up: shared_storage_path ----------------------------------------------------


def test_storage_root_is_created_when_missing(tmp_path: Path) -> None:
    root = tmp_path / "new" / "hs"
    assert check_storage_root(str(root)) == str(root)
    assert root.is_dir() and list(root.iterdir()) == []


def test_storage_root_that_is_a_regular_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "hs"
    target.write_text("not a directory")
    with pytest.raises(StorageRootError) as info:
        check_storage_root(str(target))
    message = str(info.value)
    assert "shared_storage_path" in message and str(target) in message
    assert "not a directory" in info.value.reason
    assert target.read_text() == "not a directory"


def test_storage_root_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "hs"
    with pytest.raises(StorageRootError) as info:
        check_storage_root(str(target))
    assert "shared_storage_path" in str(info.value) and str(target) in str(info.value)
    assert f"{str(tmp_path / 'file')!r} exists and is not a directory" in info.value.reason


def test_storage_root_error_is_a_value_error_naming_the_setting() -> None:
    exc = StorageRootError("/data/hs", "because")
    assert isinstance(exc, ValueError)
    assert str(exc).startswith("shared_storage_path: cannot write hidden states to '/data/hs'")


@pytest.mark.skipif(not UNSHARE, reason="no private read-only bind mounts here (unshare -m)")
def test_storage_root_on_a_read_only_mount_is_refused(world_dir: Path) -> None:
    root = world_dir / "hs"
    root.mkdir()
    got = run_in_read_only_mount(root, CHECK_ROOT.format(path=str(root)))
    assert got["error"] is not None, "a read-only root passed the start-up check"
    assert "shared_storage_path" in got["error"] and str(root) in got["error"]
    assert "Read-only file system" in got["reason"] and "EROFS" in got["reason"]
    assert list(root.iterdir()) == []


@pytest.mark.skipif(not UNSHARE, reason="no private read-only bind mounts here (unshare -m)")
def test_missing_storage_root_on_a_read_only_mount_is_refused(world_dir: Path) -> None:
    got = run_in_read_only_mount(world_dir, CHECK_ROOT.format(path=str(world_dir / "hs")))
    assert got["error"] is not None
    assert "cannot be created" in got["reason"] and "EROFS" in got["reason"]


def test_storage_root_this_process_may_not_write_is_refused(world_dir: Path) -> None:
    root = world_dir / "hs"
    root.mkdir()
    root.chmod(0o755)  # owned by the test's user; others may list it, not write it
    if os.geteuid() == 0:
        got = run_unprivileged(CHECK_ROOT.format(path=str(root)))
        error, reason = got["error"], got["reason"]
    else:
        root.chmod(0o555)
        with pytest.raises(StorageRootError) as info:
            check_storage_root(str(root))
        error, reason = str(info.value), info.value.reason
    assert error is not None and "shared_storage_path" in error and str(root) in error
    assert reason.startswith("cannot create a file in it") and "EACCES" in reason


# -- schedule time: usable_directory --------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_usable_directory_accepts_a_writable_directory(hs_dir: Path) -> None:
    assert usable_directory(str(hs_dir)) is None
    assert list(hs_dir.iterdir()) == []


def test_usable_directory_judges_a_missing_directory_by_its_ancestor(hs_dir: Path) -> None:
    cache = DirectoryProbeCache()
    assert cache.usable_directory(str(hs_dir / "a" / "b")) is None
    assert list(hs_dir.iterdir()) == [], "nothing may be created at schedule time"
    (hs_dir / "f").write_text("x")
    reason = cache.usable_directory(str(hs_dir / "f" / "b"))
    assert reason == f"{hs_dir / 'f'} is not a directory"
    assert cache.usable_directory(str(hs_dir / "f")) == "it is not a directory"


def test_usable_directory_probes_each_directory_once_per_ttl(hs_dir: Path) -> None:
    clock = FakeClock()
    cache = DirectoryProbeCache(ttl=10.0, clock=clock)
    sub = hs_dir / "sub"
    sub.mkdir()
    for _ in range(100):
        assert cache.usable_directory(str(sub)) is None
        assert cache.usable_directory(str(hs_dir)) is None
    assert cache.probes == 2
    # The directory becomes unusable: the cached answer stands until the TTL runs out.
    sub.rmdir()
    sub.write_text("now a file")
    clock.now += 9.9
    assert cache.usable_directory(str(sub)) is None
    assert cache.probes == 2
    clock.now += 0.2
    assert cache.usable_directory(str(sub)) == "it is not a directory"
    assert cache.probes == 3
    cache.forget()
    assert cache.usable_directory(str(sub)) == "it is not a directory"
    assert cache.probes == 4


def test_usable_directory_cache_is_bounded(hs_dir: Path) -> None:
    cache = DirectoryProbeCache(max_entries=8)
    for i in range(50):
        assert cache.usable_directory(str(hs_dir / f"d{i}")) is None
    assert len(cache._answers) == 8
    cache.usable_directory(str(hs_dir / "d49"))
    assert cache.probes == 50  # the most recent ones are still cached


@pytest.mark.skipif(not UNSHARE, reason="no private read-only bind mounts here (unshare -m)")
def test_usable_directory_reports_a_read_only_mount(world_dir: Path) -> None:
    sub = world_dir / "client"
    sub.mkdir()
    got = run_in_read_only_mount(world_dir, ASK_DIRECTORY.format(path=str(sub)))
    assert got["reason"].startswith("cannot create a file in it") and "EROFS" in got["reason"]
    got = run_in_read_only_mount(world_dir, ASK_DIRECTORY.format(path=str(sub / "new")))
    assert "does not exist and cannot be created in" in got["reason"]
    assert "EROFS" in got["reason"]


def test_usable_directory_reports_a_directory_this_process_may_not_write(
    world_dir: Path,
) -> None:
    if os.geteuid() != 0:
        world_dir.chmod(0o555)
        reason = DirectoryProbeCache().usable_directory(str(world_dir))
        world_dir.chmod(0o755)
    else:
        got = run_unprivileged(ASK_DIRECTORY.format(path=str(world_dir)))
        reason = got["reason"]
    assert reason is not None
    assert reason.startswith("cannot create a file in it") and "EACCES" in reason
