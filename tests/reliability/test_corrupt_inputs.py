"""Scenario 4: corrupt, hostile and vanishing inputs never crash or hang a reader.

Every bad entry must be skipped with one clear warning naming it and counted in
``reader.stats`` (``on_error="skip"``), or raise a typed ``SampleError`` naming it
(``on_error="raise"``); good samples around it are still yielded; ``hidden-state
verify`` reports it (exit 1) without crashing or hanging. File-content cases run in
this process; file-system cases (FIFOs, directories, symlink loops, unreadable files)
run through ``tests/tools/read_dir.py`` in a subprocess with a timeout, so a reader
that blocks forever is reported as a failure instead of stalling the suite.

The header parser is fuzzed with hypothesis (``parse_header``, ``read_header``,
``load_sample`` and the reader over the same bytes): only ``SampleError`` subclasses
may escape.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hidden_state_reader import (
    CorruptSampleError,
    HiddenStateReader,
    IncompleteSampleError,
    SampleError,
    load_sample,
    read_header,
    write_sample,
)
from hidden_state_reader.apps.cli.main import main as cli_main
from hidden_state_reader.format.header import parse_header

from bad_files import CASES, HIDDEN, LAYERS, TOKENS, foreign_good_bytes, good_bytes, spec
from tools.relkit import TOOLS, Figures

READ_DIR = [sys.executable, str(TOOLS / "read_dir.py")]
BAD = "bad.safetensors"


def cases(names: Iterable[str]) -> list[Any]:
    return sorted(names)


@pytest.fixture
def bad_dir(hs_dir: Path) -> Path:
    """good_0, the bad entry (added by the test), good_1."""
    for i in range(2):
        token_ids = torch.arange(TOKENS) + 10 * i
        write_sample(
            hs_dir / f"good_{i}.safetensors", token_ids, torch.ones(TOKENS, LAYERS, HIDDEN)
        )
    return hs_dir


def verify_in_process(root: Path) -> int:
    """``hidden-state verify --grace 0 --json`` in this process (a subprocess per case
    would cost a second each). The CLI installs its own logging handler on the root
    logger, bound to the current (captured) stderr: put the old ones back after."""
    logger = logging.getLogger()
    handlers, level = logger.handlers[:], logger.level
    try:
        return cli_main(["verify", str(root), "--grace", "0", "--json"])
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def warnings_about(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and name in r.getMessage()
    ]


# -- file contents --------------------------------------------------------------------


@pytest.mark.parametrize("case", cases(CASES))
def test_bad_file_content_is_a_typed_error_and_skipped_once(
    bad_dir: Path,
    case: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    figures: Figures,
) -> None:
    make, expected = CASES[case]
    path = bad_dir / BAD
    path.write_bytes(make())
    os.utime(path, (time.time() - 60, time.time() - 60))  # not "still being written"

    # The format layer: a typed error, naming the file, and nothing else.
    if expected is None:
        assert load_sample(path).num_tokens == 0
    else:
        with pytest.raises(expected, match=BAD):
            load_sample(path)

    # The reader, skipping: the good samples around it, one warning naming it.
    caplog.set_level(logging.WARNING, logger="hidden_state_reader")
    reader = HiddenStateReader(bad_dir)
    got = sorted(os.path.basename(s.path) for s in reader)
    assert got == ["good_0.safetensors", "good_1.safetensors"]
    assert len(warnings_about(caplog, BAD)) == 1, caplog.text
    assert reader.stats.skipped == 1
    if expected is IncompleteSampleError:
        assert reader.stats.incomplete == 1
    elif expected is CorruptSampleError:
        assert reader.stats.corrupt == 1
    else:
        assert reader.stats.empty == 1

    # The reader, raising: a typed error that names the file.
    if expected is not None:
        with pytest.raises(SampleError, match=BAD) as info:
            list(HiddenStateReader(bad_dir, names=[BAD], on_error="raise"))
        assert isinstance(info.value, expected)

    # verify reports it (a zero-token file is "empty": the state the reader skips).
    capsys.readouterr()
    rc = verify_in_process(bad_dir)
    verdict = json.loads(capsys.readouterr().out)
    states = {p["name"]: p["state"] for p in verdict["problems"]}
    if expected is None:
        assert rc == 1
        assert states == {BAD: "empty"}
    else:
        assert rc == 1
        want = "incomplete" if expected is IncompleteSampleError else "corrupt"
        assert states == {BAD: want}
    figures.record(case, load_error=None if expected is None else expected.__name__, verify=states)


# -- file-system entries that are not regular files -------------------------------------


def _fifo(root: Path) -> None:
    os.mkfifo(root / BAD)


def _directory(root: Path) -> None:
    (root / BAD).mkdir()


def _symlink_loop(root: Path) -> None:
    os.symlink(BAD, root / BAD)


def _dangling_symlink(root: Path) -> None:
    os.symlink("nowhere/at/all", root / BAD)


def _unreadable(root: Path) -> None:
    (root / BAD).write_bytes(good_bytes())
    os.chmod(root / BAD, 0)


# The lock cases use another writer's file: one of ours, published by rename, a snapshot
# reader may read without its lock (test_our_published_file_is_read_whatever_its_lock).
def _lock_is_fifo(root: Path) -> None:
    (root / BAD).write_bytes(foreign_good_bytes())
    os.mkfifo(root / (BAD + ".lock"))


def _unreadable_lock(root: Path) -> None:
    (root / BAD).write_bytes(foreign_good_bytes())
    (root / (BAD + ".lock")).write_bytes(b"")
    os.chmod(root / (BAD + ".lock"), 0)


FS_CASES: dict[str, tuple[Callable[[Path], None], bool]] = {
    # name -> (make it, run as uid 65534)
    "fifo": (_fifo, False),
    "directory": (_directory, False),
    "symlink-loop": (_symlink_loop, False),
    "dangling-symlink": (_dangling_symlink, False),
    "unreadable-file": (_unreadable, True),
    "lock-is-fifo": (_lock_is_fifo, False),
    "unreadable-lock": (_unreadable_lock, True),
}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A storage root that uid 65534 may enter (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="hs-reliability-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


class ReadDir:
    """Runs ``read_dir.py`` jobs in forked children of one warm process, each bounded."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.proc = subprocess.Popen(
            [*READ_DIR, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        self.count = 0

    def start(self, root: Path, *options: str) -> tuple[int, Path]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.count += 1
        out = self.results / f"job-{self.count}.json"
        self.proc.stdin.write(f"run {out} {root} {' '.join(options)}\n")
        self.proc.stdin.flush()
        words = self.proc.stdout.readline().split()
        assert words[0] == "pid", words
        return int(words[1]), out

    @staticmethod
    def finish(job: tuple[int, Path], deadline: float) -> dict[str, Any] | None:
        """The job's report, or None if it was still running at ``deadline`` (killed)."""
        pid, out = job
        while time.monotonic() < deadline:
            text = out.read_text() if out.exists() else ""
            if text.endswith("\n"):
                report = dict(json.loads(text))
                assert "crash" not in report, report["crash"]
                return report
            time.sleep(0.05)  # polling a file another process writes
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def read_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadDir]:
    results = tmp_path_factory.mktemp("read-dir")
    server = ReadDir(results)
    try:
        yield server
    finally:
        server.close()


HANG_LIMIT = 5.0  # seconds; a healthy run takes well under one


@pytest.mark.parametrize("case", cases(FS_CASES))
def test_entry_that_is_not_a_regular_file_is_skipped_not_fatal(
    open_dir: Path, case: str, read_dir: ReadDir, figures: Figures
) -> None:
    make, as_nobody = FS_CASES[case]
    if as_nobody and os.geteuid() != 0:
        pytest.skip("needs root to drop to uid 65534 (as root, file modes do not stop reads)")
    for i in range(2):
        write_sample(open_dir / f"good_{i}.safetensors", torch.arange(TOKENS), torch.ones(4, 2, 8))
    make(open_dir)
    nobody = ["--as-nobody"] if as_nobody else []

    # The three run at once, each bounded: a hang costs HANG_LIMIT, not three times it.
    jobs = [
        read_dir.start(open_dir, *nobody),
        read_dir.start(open_dir, "--on-error", "raise", *nobody),
        read_dir.start(open_dir, "--verify", *nobody),
    ]
    deadline = time.monotonic() + HANG_LIMIT
    skip, raised, verified = (read_dir.finish(j, deadline) for j in jobs)
    figures.record(
        case,
        skip_mode="hung" if skip is None else (skip["error"] or "ok"),
        raise_mode="hung" if raised is None else (raised["error"] or "ok"),
        verify="hung" if verified is None else verified["rc"],
    )

    assert skip is not None, f"the reader hung (killed after {HANG_LIMIT:g} s)"
    assert skip["error"] is None, f"the reader's loop crashed: {skip['error']}"
    assert skip["yielded"] == ["good_0.safetensors", "good_1.safetensors"]
    stats = skip["stats"]
    if case == "dangling-symlink":
        assert stats["vanished"] == 1  # like a file removed between listing and reading
    else:
        assert stats["skipped"] == 1, stats
        assert len([w for w in skip["warnings"] if BAD in w]) == 1, skip["warnings"]
    assert raised is not None, f"the reader hung (killed after {HANG_LIMIT:g} s)"
    if case != "dangling-symlink":
        assert raised["error"] is not None and raised["error"]["sample_error"], raised["error"]
        assert BAD in raised["error"]["message"]
    assert verified is not None, f"hidden-state verify hung (killed after {HANG_LIMIT:g} s)"
    if case != "dangling-symlink":
        assert verified["rc"] == 1, verified["output"]
        problems = json.loads(verified["output"])["problems"]
        assert [p["name"] for p in problems] == [BAD]


@pytest.mark.parametrize("case", ["lock-is-fifo", "unreadable-lock"])
def test_our_published_file_is_read_whatever_its_lock(
    open_dir: Path, case: str, read_dir: ReadDir
) -> None:
    """A small complete file of ours is final once it has its name (docs/format.md, "Files
    published by rename"): a snapshot reader yields it without opening its lock, so a lock
    that is a FIFO or unreadable loses no sample. Followers and ``verify`` keep to the
    lock, which the cases above check."""
    as_nobody = FS_CASES[case][1]
    if as_nobody and os.geteuid() != 0:
        pytest.skip("needs root to drop to uid 65534 (as root, file modes do not stop reads)")
    (open_dir / BAD).write_bytes(good_bytes())
    if case == "lock-is-fifo":
        os.mkfifo(open_dir / (BAD + ".lock"))
    else:
        (open_dir / (BAD + ".lock")).write_bytes(b"")
        os.chmod(open_dir / (BAD + ".lock"), 0)
    nobody = ["--as-nobody"] if as_nobody else []
    report = read_dir.finish(read_dir.start(open_dir, *nobody), time.monotonic() + HANG_LIMIT)
    assert report is not None, f"the reader hung (killed after {HANG_LIMIT:g} s)"
    assert report["error"] is None, report["error"]
    assert report["yielded"] == [BAD]
    assert report["stats"]["skipped"] == 0 and report["warnings"] == []


# -- files vanishing between listing and reading ---------------------------------------


def test_files_vanishing_mid_iteration_are_counted_not_fatal(
    hs_dir: Path, caplog: pytest.LogCaptureFixture, figures: Figures
) -> None:
    for i in range(40):
        write_sample(hs_dir / f"hs_{i}.safetensors", torch.arange(TOKENS), torch.ones(4, 2, 8))
    caplog.set_level(logging.WARNING, logger="hidden_state_reader")
    reader = HiddenStateReader(hs_dir)
    got = []
    for n, sample in enumerate(reader):
        got.append(os.path.basename(sample.path))
        if n == 0:  # listed already; now half of them vanish (consumed by someone else)
            for i in range(1, 40, 2):
                os.unlink(hs_dir / f"hs_{i}.safetensors")
                os.unlink(hs_dir / f"hs_{i}.safetensors.lock")
        if n == 5:  # and a data file whose lock stays behind
            os.unlink(hs_dir / "hs_20.safetensors")
    assert len(got) == 19
    assert reader.stats.vanished == 20
    assert reader.stats.stale_locks == reader.stats.skipped == 1  # hs_20: lock, no data
    figures.record("vanishing", yielded=len(got), stats=reader.stats.as_dict())


# -- all at once ------------------------------------------------------------------------


def test_a_directory_of_every_bad_entry_at_once(
    open_dir: Path, read_dir: ReadDir, figures: Figures
) -> None:
    for i in range(5):
        write_sample(open_dir / f"good_{i}.safetensors", torch.arange(TOKENS), torch.ones(4, 2, 8))
    for case, (make, _) in CASES.items():
        (open_dir / f"{case}.safetensors").write_bytes(make())
    for case, (make_fs, _) in FS_CASES.items():
        sub = open_dir / ".tmp-build"
        sub.mkdir()
        make_fs(sub)
        for entry in os.listdir(sub):
            os.rename(sub / entry, open_dir / entry.replace("bad", f"fs-{case}"))
        sub.rmdir()
    past = time.time() - 60
    for entry in os.listdir(open_dir):
        os.utime(open_dir / entry, (past, past), follow_symlinks=False)
    started = time.monotonic()
    nobody = ["--as-nobody"] if os.geteuid() == 0 else []
    result = read_dir.finish(read_dir.start(open_dir, *nobody), time.monotonic() + HANG_LIMIT)
    figures.record(
        "all-at-once",
        bad_entries=len(CASES) + len(FS_CASES),
        outcome="hung" if result is None else (result["error"] or "ok"),
        stats=None if result is None else result["stats"],
        seconds=round(time.monotonic() - started, 2),
    )
    assert result is not None, "the reader hung"
    assert result["error"] is None, result["error"]
    assert sorted(result["yielded"]) == [f"good_{i}.safetensors" for i in range(5)]


# -- fuzzing the header ---------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
DTYPE_NAMES = st.sampled_from(
    ["BF16", "F16", "F32", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", ""]
)
DIMS = (
    st.integers(0, 64)
    | st.sampled_from([-1, 2**31, 2**63 - 1, 2**63, 2**64 + 1, 2**70])
    | st.integers(-3, 2**70)
)


@st.composite
def tensor_specs(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON_VALUES)
    out: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        out["dtype"] = draw(DTYPE_NAMES | JSON_VALUES) if draw(st.booleans()) else draw(DTYPE_NAMES)
    if draw(st.integers(0, 9)):
        out["shape"] = draw(st.lists(DIMS, max_size=4) | JSON_VALUES)
    if draw(st.integers(0, 9)):
        lo = draw(st.integers(-2, 4096) | st.integers(0, 2**66))
        out["data_offsets"] = draw(st.just([lo, lo + draw(st.integers(-2, 4096))]) | JSON_VALUES)
    return out


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A correct header with (usually) one thing changed; its data-section size."""
    tokens = draw(st.integers(0, 6))
    layers, hidden = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    hdtype = draw(st.sampled_from(["BF16", "F16", "F32"]))
    tdtype = draw(st.sampled_from(["I64", "I32"]))
    tsize, hsize = {"I64": 8, "I32": 4}[tdtype], {"BF16": 2, "F16": 2, "F32": 4}[hdtype]
    tok, hid = tokens * tsize, tokens * layers * hidden * hsize
    first_tokens = tsize >= hsize
    t0, h0 = (0, tok) if first_tokens else (hid, 0)
    doc: dict[str, Any] = {
        "token_ids": spec(tdtype, [tokens], t0, t0 + tok),
        "hidden_states": spec(hdtype, [tokens, layers, hidden], h0, h0 + hid),
    }
    if draw(st.booleans()):
        doc["__metadata__"] = {"layer_ids": draw(st.sampled_from(["[1, 2]", "[", "{}", "[1.5]"]))}
    change = draw(st.integers(0, 5))
    target = doc[draw(st.sampled_from(["token_ids", "hidden_states"]))]
    if change == 1:  # a dimension, possibly huge
        shape = list(target["shape"])
        shape[draw(st.integers(0, len(shape) - 1))] = draw(DIMS)
        target["shape"] = shape
    elif change == 2:  # a dtype
        target["dtype"] = draw(DTYPE_NAMES | JSON_VALUES)
    elif change == 3:  # an offset
        lo, hi = target["data_offsets"]
        target["data_offsets"] = [lo + draw(st.integers(-9, 9)), hi + draw(st.integers(-9, 9))]
    elif change == 4:  # an extra tensor
        doc[draw(st.text(max_size=4))] = draw(tensor_specs())
    return doc, tok + hid


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """(header bytes, data-section size): near-valid headers, random structures, raw bytes,
    deep nesting."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=200)), draw(st.integers(0, 256))
    if kind == 1:
        depth = draw(st.integers(1, 200_000))
        return b"[" * depth + b"]" * depth, 0
    if kind <= 5:
        doc, size = draw(near_valid())
        return json.dumps(doc).encode(), size
    doc = {}
    for name in ("token_ids", "hidden_states"):
        if draw(st.integers(0, 9)):
            doc[name] = draw(tensor_specs())
    if draw(st.booleans()):
        doc["__metadata__"] = draw(JSON_VALUES | st.dictionaries(st.text(max_size=9), st.text()))
    if draw(st.integers(0, 4)) == 0:
        doc[draw(st.text(max_size=5))] = draw(tensor_specs())
    return json.dumps(doc).encode(), draw(st.integers(0, 4096))


def check_only_sample_errors(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except SampleError:
        return None


FUZZ_EXAMPLES = {False: 500, True: 20_000}


def _fuzz_settings(n: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=n == FUZZ_EXAMPLES[False],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _fuzz_one(directory: Path, header: bytes, data_len: int, size_delta: int) -> None:
    # 1. The pure parser, with the file size it would have (or a wrong one).
    expected = 8 + len(header) + data_len
    check_only_sample_errors(
        lambda: parse_header("f.safetensors", header, max(0, expected + size_delta))
    )
    # 2. The same bytes as a real file, through read_header, load_sample and a reader.
    path = directory / "f.safetensors"
    blob = struct.pack("<Q", len(header)) + header + bytes(data_len)
    blob = blob[: max(0, len(blob) + min(0, size_delta))] + bytes(max(0, size_delta))
    path.write_bytes(blob)
    check_only_sample_errors(lambda: read_header(path))
    sample = check_only_sample_errors(lambda: load_sample(path))
    if sample is not None:
        token_ids, hidden = sample  # type: ignore[misc]
        assert hidden.dim() == 3 and token_ids.shape[0] == hidden.shape[0]
    list(HiddenStateReader(directory, orphan_grace=0))


def _fuzz_test(n: int, directory: Path) -> Callable[[], None]:
    @_fuzz_settings(n)
    @given(headers(), st.sampled_from([0, 0, 0, -1, 1]) | st.integers(-64, 64))
    # Regression seeds: what this suite found (see docs/reliability.md).
    @example((json.dumps({"hidden_states": {"dtype": ["BF16"]}}).encode(), 0), 0)
    @example((b"[" * 50_000 + b"]" * 50_000, 0), 0)
    @example(
        (
            json.dumps(
                {
                    "token_ids": spec("I64", [1], 0, 8),
                    "hidden_states": spec("F32", [1, 2**70, 0], 8, 8),
                }
            ).encode(),
            8,
        ),
        0,
    )
    def fuzz(header: tuple[bytes, int], size_delta: int) -> None:
        _fuzz_one(directory, header[0], header[1], size_delta)

    return fuzz


def test_fuzz_header_only_sample_errors_escape(tmp_path: Path, figures: Figures) -> None:
    started = time.monotonic()
    _fuzz_test(FUZZ_EXAMPLES[False], tmp_path)()
    figures.record(
        "fuzz", examples=FUZZ_EXAMPLES[False], seconds=round(time.monotonic() - started, 1)
    )


@pytest.mark.long
def test_fuzz_header_long(tmp_path: Path, figures: Figures) -> None:
    started = time.monotonic()
    _fuzz_test(FUZZ_EXAMPLES[True], tmp_path)()
    figures.record(
        "fuzz", examples=FUZZ_EXAMPLES[True], seconds=round(time.monotonic() - started, 1)
    )
