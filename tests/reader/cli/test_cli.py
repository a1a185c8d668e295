"""The ``hidden-state`` CLI, run as a real subprocess on real directories."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from hidden_state_reader.apps.cli import main as cli_main
from hidden_state_reader.apps.cli.common import file_progress
from hidden_state_reader.apps.cli.table import format_table
from hidden_state_reader.apps.cli.toolkit import format_bytes
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import write_sample

from procs import LockHolder
from samples import make_tensors, write_raw, write_samples, write_vllm_style

PAST = time.time() - 3600
CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]


def run(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )


def call(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Run the CLI in this process (for the cheap variants): status, stdout, stderr."""
    capsys.readouterr()
    rc = cli_main.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def age(path: Path) -> None:
    os.utime(path, (PAST, PAST))


# Every state the tools know, and what they must report for it.
ZOO_STATES = {
    "crc_bad.safetensors": "ready",  # corrupt only with --checksums
    "crc_ok.safetensors": "ready",
    "empty.safetensors": "incomplete",
    "failed.safetensors": "failed",
    "garbage.safetensors": "corrupt",
    "held.safetensors": "pending",
    "hs_0.safetensors": "ready",
    "hs_1.safetensors": "ready",
    "hs_2.safetensors": "ready",
    "mismatch.safetensors": "corrupt",
    "missing.safetensors": "corrupt",
    "stale.safetensors": "stale",
    "truncated.safetensors": "incomplete",
    "vllm_0.safetensors": "ready",
    "wrong_dtype.safetensors": "corrupt",
}
YOUNG_TEMP = "young.safetensors.tmp.4242.cafe"
ZOO_TEMPS = {
    "hs_9.safetensors.tmp.4242.deadbeef": "orphan_temp",
    "held.safetensors.tmp.4242.beef": "pending",  # old, but its sample's lock is held
    YOUNG_TEMP: "pending",
}


def build_zoo(root: Path, holder: LockHolder) -> Path:
    """A directory with one file of every kind (see ZOO_STATES / ZOO_TEMPS)."""
    root.mkdir(exist_ok=True)
    write_samples(root, 3, tokens=[4, 8, 12], layer_ids=[5, 10, 15], checksum=False)  # no CRC32
    write_vllm_style(root / "vllm_0.safetensors", 0)
    token_ids, hidden = make_tensors(7)
    write_sample(root / "crc_ok.safetensors", token_ids, hidden, checksum=True)
    bad = root / "crc_bad.safetensors"
    write_sample(bad, token_ids, hidden, checksum=True)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    (root / "truncated.safetensors").write_bytes((root / "hs_0.safetensors").read_bytes()[:-50])
    (root / "garbage.safetensors").write_bytes(bytes(range(256)) * 3)
    (root / "empty.safetensors").write_bytes(b"")
    write_raw(
        root / "wrong_dtype.safetensors",
        {"hidden_states": (torch.int64, (4, 3, 8)), "token_ids": (torch.int64, (4,))},
    )
    write_raw(root / "missing.safetensors", {"hidden_states": (torch.float32, (4, 3, 8))})
    write_raw(
        root / "mismatch.safetensors",
        {"hidden_states": (torch.float32, (4, 3, 8)), "token_ids": (torch.int64, (5,))},
    )
    lock = WriterLock.create(str(root / "failed.safetensors"))
    lock.mark_failed("CUDA out of memory")
    lock.release()
    stale = WriterLock.create(str(root / "stale.safetensors"))
    stale.release()
    for name in ZOO_TEMPS:
        (root / name).write_bytes(b"x" * 100)
    holder.lock(root / "held.safetensors")
    for name in (
        "truncated.safetensors",
        "empty.safetensors",
        "stale.safetensors.lock",
        "hs_9.safetensors.tmp.4242.deadbeef",
        "held.safetensors.tmp.4242.beef",
    ):
        age(root / name)
    return root


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory, holder: LockHolder) -> Iterator[Path]:
    root = build_zoo(tmp_path_factory.mktemp("zoo") / "hs", holder)
    yield root
    holder.release(root / "held.safetensors")


@pytest.fixture
def zoo(zoo_dir: Path) -> Path:
    """The shared zoo, its young temp file made young again (a temp file older than the
    grace period counts as an orphan, and CLI runs take seconds each on a loaded machine)."""
    os.utime(zoo_dir / YOUNG_TEMP)
    return zoo_dir


def ls_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of ``ls`` (between the header and the summary line), keyed by NAME."""
    lines = stdout.splitlines()
    return {line.split()[0]: line.split() for line in lines[1:-1]}


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


# -- help and usage -----------------------------------------------------------------

COMMANDS = ["ls", "stats", "inspect", "verify", "clean", "tail"]


def test_top_level_help_lists_every_command() -> None:
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert f"    {command} " in proc.stdout
    assert "examples:" in proc.stdout
    no_traceback(proc)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_description_and_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hidden-state {command}")
    assert "examples:\n" in out and f"  hidden-state {command} " in out
    description = out.split("\n\n")[1]
    assert len(description) > 40


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main([]) == 2
    assert cli_main.main(["verify"]) == 2  # DIR missing
    assert "the following arguments are required: DIR" in capsys.readouterr().err
    assert cli_main.main(["ls", "--no-such-option", "."]) == 2
    assert cli_main.main(["tail", ".", "--max-samples", "0"]) == 2
    assert cli_main.main(["clean", ".", "--older-than", "-1"]) == 2


# -- ls / stats ---------------------------------------------------------------------


def test_ls(zoo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run("ls", zoo, "--all")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [
        "NAME", "TOKENS", "LAYERS", "HIDDEN", "DTYPE", "FILE", "BYTES", "STATE"
    ]  # fmt: skip
    rows = ls_rows(proc.stdout)
    assert {name: cells[-1] for name, cells in rows.items()} == {**ZOO_STATES, **ZOO_TEMPS}
    assert rows["hs_2.safetensors"][1:5] == ["12", "3", "16", "BF16"]
    assert rows["failed.safetensors"][1:6] == ["-", "-", "-", "-", "-"]
    # Columns are aligned: every row is as wide as the header's STATE column start.
    state_col = lines[0].index("STATE")
    assert all(line[state_col - 1] == " " for line in lines[1:-1])
    assert lines[-1].startswith(
        "15 samples: 6 ready, 1 pending, 1 failed, 1 stale, 2 incomplete, 4 corrupt;"
    )
    assert "3 temporary files (2 pending, 1 orphan_temp)" in lines[-1]

    rc, out, _ = call(capsys, "ls", zoo, "--json")
    assert rc == 0
    entries = json.loads(out)
    assert {e["name"]: e["state"] for e in entries} == ZOO_STATES  # no temps without --all
    hs0 = next(e for e in entries if e["name"] == "hs_0.safetensors")
    assert hs0["tokens"] == 4 and hs0["file_bytes"] == (zoo / "hs_0.safetensors").stat().st_size


def test_stats(zoo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run("stats", zoo, "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    ready = [n for n, s in ZOO_STATES.items() if s == "ready"]
    assert stats["count"] == len(ready) == 6
    assert stats["total_tokens"] == 4 + 8 + 12 + 8 * 3
    assert stats["file_bytes"] == sum((zoo / n).stat().st_size for n in ready)
    assert (stats["min_tokens"], stats["max_tokens"], stats["mean_tokens"]) == (4, 12, 8.0)
    assert stats["layers"] == {"3": 6} and stats["hidden"] == {"16": 6}
    assert stats["dtypes"] == {"BF16": 6}
    assert stats["file_bytes_per_token"] == round(stats["file_bytes"] / stats["total_tokens"], 2)
    assert stats["states"] == {
        "ready": 6,
        "pending": 1,
        "failed": 1,
        "stale": 1,
        "incomplete": 2,
        "corrupt": 4,
    }
    assert stats["temp_files"] == {"pending": 2, "orphan_temp": 1}

    text = call(capsys, "stats", zoo)[1]
    words = " ".join(text.split())
    assert "ready samples: 6" in words and "total tokens: 48" in words
    assert f"file bytes: {format_bytes(stats['file_bytes'])}" in words
    assert "min 4  mean 8  median 8  max 12" in text


# -- verify -------------------------------------------------------------------------


PROBLEM_STATES = {"failed", "stale", "incomplete", "corrupt", "orphan_temp"}


def problem_rows(stdout: str) -> dict[str, str]:
    """``verify`` output: NAME -> state, one per problem line."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["PROBLEM", "NAME", "REASON"]
    rows = [line.split() for line in lines[1:]]
    return {cells[1]: cells[0] for cells in rows if cells[0] in PROBLEM_STATES}


def test_verify_reports_each_problem(zoo: Path) -> None:
    proc = run("verify", zoo)
    assert proc.returncode == 1, proc.stderr
    expected = {n: s for n, s in {**ZOO_STATES, **ZOO_TEMPS}.items() if s in PROBLEM_STATES}
    assert problem_rows(proc.stdout) == expected
    assert len(proc.stdout.splitlines()) == 1 + len(expected) + 2
    assert "writer reported failure: CUDA out of memory" in proc.stdout
    assert "checked 15 samples" in proc.stdout
    assert proc.stdout.endswith(
        f"{len(expected)} problems found (`hidden-state clean {zoo}` removes the 2 "
        "stale/failed locks and the 1 orphan temp file; the 6 data files it never removes)\n"
    )


def test_verify_checksums_json(zoo: Path) -> None:
    proc = run("verify", zoo, "--checksums", "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    problems = {p["name"]: p["state"] for p in report["problems"]}
    assert problems["crc_bad.safetensors"] == "corrupt"
    assert "crc_ok.safetensors" not in problems
    assert report["checksums_verified"] == 1
    assert report["states"]["corrupt"] == 5
    assert len(problems) == 10


def test_verify_clean_directory_and_bad_input(
    hs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_samples(hs_dir, 2)
    rc, out, _ = call(capsys, "verify", hs_dir)
    assert rc == 0, out
    assert out.splitlines() == [
        f"checked 2 samples in {hs_dir}: 2 ready",
        "no problems found",
    ]

    missing = tmp_path / "does-not-exist"
    proc = run("verify", missing)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"hidden-state: error: {missing}: no such directory"
    no_traceback(proc)


def test_directory_arguments_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    for command in ("ls", "stats", "verify", "clean", "tail"):
        assert cli_main.main([command, str(a_file)]) == 2
        assert capsys.readouterr().err == f"hidden-state: error: {a_file}: not a directory\n"
        assert cli_main.main([command, str(tmp_path / "nope")]) == 2
        assert "no such directory" in capsys.readouterr().err


# -- inspect ------------------------------------------------------------------------


def test_inspect_good_sample(zoo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run("inspect", zoo / "hs_1.safetensors", "--verify", "--tokens", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in (
        "tokens:      8",
        "layers:      3",
        "layer ids:   [5, 10, 15]",
        "hidden size: 16",
        "dtype:       BF16",
        "nonfinite:   no",
        "lock:        free",
        "request_id",
        "req-1",
        "token ids (first 3 of 8): [1000, 1001, 1002] ...",
        "hidden_states  BF16   [8, 3, 16]",
        "verify:      OK (no CRC32 recorded); 0 non-finite values",
    ):
        assert expected in out, expected

    rc, out, _ = call(capsys, "inspect", zoo / "crc_ok.safetensors", "--verify", "--json")
    info = json.loads(out)
    assert rc == 0
    assert info["verify"] == {"ok": True, "crc32_checked": True, "nonfinite_values": 0}
    assert info["tensors"]["token_ids"]["shape"] == [8]
    assert info["first_token_ids"] == list(range(7000, 7008))


def test_inspect_problems(zoo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = call(capsys, "inspect", zoo / "crc_bad.safetensors", "--verify")
    assert rc == 1
    assert "verify:      FAILED: CRC32 mismatch" in out

    # Not a valid sample: shown as far as it can be read, exit status 1 (a data problem).
    proc = run("inspect", zoo / "garbage.safetensors")
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert "state:      corrupt: header length" in proc.stdout
    assert "header: unreadable" in proc.stdout
    no_traceback(proc)

    cases = {
        "truncated.safetensors": "incomplete: truncated",
        "empty.safetensors": "incomplete: empty file",
        "wrong_dtype.safetensors": "corrupt: hidden_states has dtype I64",
    }
    # Only its lock exists: shown from the lock (the lock's own name works too).
    for name in ("held.safetensors", "held.safetensors.lock"):
        rc, out, _ = call(capsys, "inspect", zoo / name)
        assert rc == 0 and "pending: writer holds the lock" in out
    for name, words in cases.items():
        rc, out, err = call(capsys, "inspect", zoo / name)
        assert rc == 1 and err == "", err
        assert f"state:      {words}" in out, out
    rc, out, _ = call(capsys, "inspect", zoo / "truncated.safetensors", "--json")
    info = json.loads(out)
    assert rc == 1 and info["state"] == "incomplete"
    assert info["file_bytes"] == (zoo / "truncated.safetensors").stat().st_size
    assert set(info["header_as_written"]["tensors"]) == {"token_ids", "hidden_states"}
    # Bad usage stays exit status 2.
    assert cli_main.main(["inspect", str(zoo / "nope.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main.main(["inspect", str(zoo)]) == 2
    assert "is a directory" in capsys.readouterr().err


# -- clean --------------------------------------------------------------------------


def test_clean(tmp_path: Path, holder: LockHolder, capsys: pytest.CaptureFixture[str]) -> None:
    root = build_zoo(tmp_path / "hs", holder)
    try:
        before = sorted(os.listdir(root))
        rc, out, _ = call(capsys, "clean", root, "--dry-run")
        assert rc == 0
        assert sorted(os.listdir(root)) == before
        actions = clean_actions(out)
        assert {n: a for n, a in actions.items() if a != "kept"} == {
            "stale.safetensors.lock": "would remove",
            "hs_9.safetensors.tmp.4242.deadbeef": "would remove",
        }
        # What it keeps, it lists: too young, still being written, data files.
        kept = {n for n, a in actions.items() if a == "kept"}
        assert {
            "failed.safetensors.lock",  # younger than --older-than
            "held.safetensors.lock",
            "held.safetensors.tmp.4242.beef",
            YOUNG_TEMP,
            "garbage.safetensors",
            "truncated.safetensors",
        } <= kept
        nbytes = (root / "stale.safetensors.lock").stat().st_size + 100  # + the temp file
        assert out.splitlines()[-1] == (
            f"would remove 2 files ({format_bytes(nbytes)}) in {root}; {len(kept)} kept "
            "(see DETAIL)"
        )

        proc = run("clean", root)
        assert proc.returncode == 0, proc.stderr
        removed = set(before) - set(os.listdir(root))
        # Old leftovers go; the young failed lock, young temp file and held lock stay.
        assert removed == {"stale.safetensors.lock", "hs_9.safetensors.tmp.4242.deadbeef"}
        assert "removed 2 files" in proc.stdout
        assert "failed.safetensors.lock" in proc.stdout  # listed as kept: too young

        rc, out, _ = call(capsys, "clean", root, "--older-than", "0", "--locks")
        assert rc == 0
        left = set(os.listdir(root))
        removed = set(before) - left - removed
        assert removed == {
            "failed.safetensors.lock",
            "young.safetensors.tmp.4242.cafe",
            "hs_0.safetensors.lock",
            "hs_1.safetensors.lock",
            "hs_2.safetensors.lock",
            "crc_ok.safetensors.lock",
            "crc_bad.safetensors.lock",
        }
        # Never a data file; never what a live writer holds.
        assert {n for n in before if n.endswith(".safetensors")} <= left
        assert {"held.safetensors.lock", "held.safetensors.tmp.4242.beef"} <= left

        assert {a for n, a in clean_actions(out).items() if "held" in n} == {"kept"}
        rc, out, _ = call(capsys, "verify", root)
        assert rc == 1
        assert set(problem_rows(out).values()) == {"corrupt", "incomplete"}
    finally:
        holder.release(root / "held.safetensors")


def clean_actions(stdout: str) -> dict[str, str]:
    """``clean`` output: FILE -> action (``removed``, ``would remove``, ``kept``, ...)."""
    lines = stdout.splitlines()
    kind_col, file_col, detail_col = (lines[0].index(c) for c in ("KIND", "FILE", "DETAIL"))
    return {line[file_col:detail_col].strip(): line[:kind_col].strip() for line in lines[1:-1]}


# -- tail ---------------------------------------------------------------------------


def _start_tail(root: Path, *args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*CLI, "tail", str(root), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith(f"hidden-state tail: following {root}"), first
    return proc


def _read_lines(proc: subprocess.Popen[str], n: int) -> list[str]:
    assert proc.stdout is not None
    lines = []
    for _ in range(n):
        line = proc.stdout.readline()
        assert line, "tail exited early"
        lines.append(line.rstrip("\n"))
    return lines


def test_tail_follows_until_idle(hs_dir: Path) -> None:
    proc = _start_tail(hs_dir, "--idle-timeout", 3)
    try:
        write_samples(hs_dir, 3, tokens=[5, 6, 7])
        (hs_dir / "bad.safetensors").write_bytes(b"\xff" * 64)
        write_samples(hs_dir, 1, start=3)
        lines = _read_lines(proc, 4)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, stderr
    # Each once. A follower yields samples as it sees them complete: one it found still
    # locked (its writer between rename and release) may come after a later one.
    by_name = {line.split()[1]: line for line in lines}
    assert sorted(by_name) == [f"hs_{i}.safetensors" for i in range(4)] and len(lines) == 4
    assert "5 tokens" in by_name["hs_0.safetensors"] and "req-0" in by_name["hs_0.safetensors"]
    assert stdout == ""
    assert "skipping" in stderr and "bad.safetensors" in stderr
    assert "hidden-state tail: 4 samples, 26 tokens" in stderr
    assert "no new sample for 3s" in stderr and "1 corrupt" in stderr


def test_tail_ctrl_c_with_claims(hs_dir: Path) -> None:
    proc = _start_tail(hs_dir, "--group", "audit", "--json")
    try:
        write_samples(hs_dir, 2)
        records = [json.loads(line) for line in _read_lines(proc, 2)]
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, stderr
    # In completion order: hs_0 may still be awaited (its lock seen held) when hs_1,
    # written right after it, is found complete and printed first.
    assert sorted(r["name"] for r in records) == ["hs_0.safetensors", "hs_1.safetensors"]
    assert records[0]["tokens"] == 8 and records[0]["layers"] == 3 and records[0]["dtype"] == "BF16"
    assert "Traceback" not in stderr
    assert "hidden-state tail: 2 samples, 16 tokens" in stderr and "(interrupted)" in stderr
    claims = sorted(os.listdir(hs_dir / ".claims" / "audit"))
    assert claims == ["hs_0.safetensors.claim", "hs_1.safetensors.claim"]
    # A second reader of the group gets nothing: both samples are consumed for it.
    proc = run("tail", hs_dir, "--group", "audit", "--idle-timeout", 0.5)
    assert proc.returncode == 0 and proc.stdout == ""
    assert "0 samples" in proc.stderr and "2 done elsewhere" in proc.stderr


def test_tail_max_samples(hs_dir: Path) -> None:
    write_samples(hs_dir, 3)
    proc = run("tail", hs_dir, "--max-samples", 2)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines()] == [
        "hs_0.safetensors",
        "hs_1.safetensors",
    ]
    assert "reached --max-samples 2" in proc.stderr


# -- plugins and helpers ------------------------------------------------------------


def test_plugins_broken_ones_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hs_test_plugin.py").write_text(
        textwrap.dedent(
            """
            def register(subparsers):
                p = subparsers.add_parser("hello", help="say hello")
                p.add_argument("--code", type=int, default=3)
                p.set_defaults(handler=lambda args: args.code)

            def register_broken(subparsers):
                raise RuntimeError("plugin bug")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    group = cli_main.PLUGIN_GROUP
    fake = [
        EntryPoint("missing", "hs_no_such_module_xyz:register", group),
        EntryPoint("broken", "hs_test_plugin:register_broken", group),
        EntryPoint("hello", "hs_test_plugin:register", group),
    ]
    monkeypatch.setattr(cli_main, "entry_points", lambda group: fake)

    assert cli_main.main(["hello", "--code", "5"]) == 5
    assert cli_main.main(["-v", "ls", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "no samples in" in captured.out
    assert "skipping CLI plugin missing" in captured.err
    assert "skipping CLI plugin broken" in captured.err and "plugin bug" in captured.err
    assert cli_main.main(["ls", str(tmp_path)]) == 0
    assert "skipping" not in capsys.readouterr().err  # quiet without -v


def test_progress_lines() -> None:
    stream = io.StringIO()
    progress = file_progress("scanning x", True, every=2, stream=stream)
    for i in range(1, 6):
        progress(i, 5)
    assert stream.getvalue().splitlines() == [
        "hidden-state: scanning x: 2/5 files",
        "hidden-state: scanning x: 4/5 files",
        "hidden-state: scanning x: 5/5 files",
    ]
    quiet = io.StringIO()
    file_progress("x", False, stream=quiet)(1000, 1000)
    assert quiet.getvalue() == ""


def test_progress_flag_on_a_large_directory(hs_dir: Path) -> None:
    for i in range(1200):
        (hs_dir / f"s_{i}.safetensors.lock").write_bytes(b"")
    proc = run("stats", hs_dir, "--progress", "--json")
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [
        f"hidden-state: scanning {hs_dir}: 1,000/1,200 files",
        f"hidden-state: scanning {hs_dir}: 1,200/1,200 files",
    ]
    assert json.loads(proc.stdout)["states"] == {"pending": 1200}


def test_table_helpers() -> None:
    assert format_table(["NAME", "N"], [["a", 1], ["bbb", 22]], align="lr") == (
        "NAME   N\na      1\nbbb   22"
    )
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 GiB",
    ]
