"""Health checks of a hidden-state directory: classify every sample without blocking.

``check_sample`` looks at one sample (its data file and its companion lock) and says in
which state it is; ``check_temp`` does the same for an in-progress temporary file;
``scan_health`` walks a whole storage directory. Nothing here waits for a writer or
modifies a file: a lock is only *probed* (``flock(LOCK_SH | LOCK_NB)``), and a data
file is judged by the loader's own rule (``sample.content.examine``) from its header (a
few hundred bytes) and, for a file with a ``loss_mask``, one byte per token; ``ready``
means a reader with the same options yields it. ``hidden-state ls``, ``stats``,
``verify``, ``clean``, ``inspect`` and ``len(HiddenStateDataset)`` are built on this
module.

States (``hidden_state_reader.sample.states.SampleState``): ``ready``,
``pending``, ``failed``, ``stale``, ``incomplete``, ``corrupt``, ``empty`` and
``orphan_temp``; the rule that assigns them is ``states.judge``, the same one the reader
uses to decide whether to yield, wait or skip, with the same grace period.

Example::

    from hidden_state_reader.sample.health import scan_health

    for health in scan_health("/data/hs"):
        if health.problem:
            print(health.state.value, health.name, health.reason)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError, SampleError
from hidden_state_reader.files.fileio import open_sample
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.identity import WriterCheck, WriterFate, check_writer
from hidden_state_reader.files.listing import list_entries
from hidden_state_reader.files.locks import probe, read_status
from hidden_state_reader.format.header import Meta, SampleHeader
from hidden_state_reader.format.lock_status import LockState, LockStatus
from hidden_state_reader.format.names import (
    DATA_SUFFIX,
    LOCK_SUFFIX,
    TEMP_INFIX,
    Kind,
    classify,
    lock_path,
    sample_key,
)
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.content import examine
from hidden_state_reader.sample.states import GRACE, SampleState, judge, observe

ProgressCallback = Callable[[int, int], None]
"""``progress(done, total)``: called by ``scan_health`` after each directory entry."""


PROBLEM_STATES = frozenset(s for s in SampleState if s.is_problem)
"""States that ``hidden-state verify`` reports as problems."""


@dataclass(frozen=True)
class SampleHealth:
    """What a non-blocking look at one sample (or temporary file) found.

    Attributes:
        name: The sample name (``NAME.safetensors``) or the temporary file's name.
        path: The data file's path (whether or not it exists), or the temporary file's.
        state: The verdict.
        reason: Why, in a few words (empty for a plain ``ready`` sample).
        header: The validated header, when the data file has one.
        lock: What probing the lock file found (for a temporary file: the lock that
            would protect it).
        lock_status: The status the writer left in the lock file, when one was read (see
            ``current_lock_status`` for whether it still describes the sample).
        size: File bytes of the data (or temporary) file; None if there is none.
        age: Seconds since the newest of the data and lock files (or the temporary
            file) was modified.
        checksum_verified: True when a recorded CRC32 was checked and matched.
        is_temp: This entry is a temporary file, not a sample.
        writer: For a free lock without data (or a temporary file's free lock): what is
            known of its writer's process.
    """

    name: str
    path: str
    state: SampleState
    reason: str = ""
    header: SampleHeader | None = None
    lock: LockState = LockState.ABSENT
    lock_status: LockStatus | None = None
    size: int | None = None
    age: float | None = None
    checksum_verified: bool = False
    is_temp: bool = False
    writer: WriterCheck | None = None

    @property
    def writer_gone(self) -> bool:
        """The lock's writer ran on this host and is gone: no grace period is needed."""
        return self.writer is not None and self.writer.fate is WriterFate.GONE

    @property
    def ok(self) -> bool:
        """The sample is ready to be read."""
        return self.state is SampleState.READY

    @property
    def problem(self) -> bool:
        """The entry needs attention (see ``PROBLEM_STATES``)."""
        return self.state.is_problem

    @property
    def current_lock_status(self) -> LockStatus | None:
        """The writer's status in the lock file, when it describes the sample now.

        A writer records ``writing`` (with its pid, host and request id) when it starts
        and does not rewrite it once the data file is published. So for a sample whose
        data file is there and whose lock is no longer held, that status is history and
        this is None (``as_dict`` keeps the writer's details under ``writer``).
        """
        status = self.lock_status
        if status is None or status.state is None:
            return None
        if self.lock is not LockState.HELD and self.size is not None and not status.failed:
            return None
        return status

    @property
    def lock_path(self) -> str | None:
        """The lock file that governs this entry, if any can exist."""
        if not self.is_temp:
            return lock_path(self.path)
        return temp_owner_lock(self.path)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly summary (header fields flattened, no tensor data)."""
        out: dict[str, Any] = {
            "name": self.name,
            "path": self.path,
            "state": self.state.value,
            "reason": self.reason,
            "kind": "temp" if self.is_temp else "sample",
            "lock": self.lock.value,
            "file_bytes": self.size,
            "age": None if self.age is None else round(self.age, 3),
        }
        current = self.current_lock_status
        if current is not None:
            out["lock_status"] = {"state": current.state, **current.detail}
        elif self.lock_status is not None and self.lock_status.detail:
            out["writer"] = dict(self.lock_status.detail)  # who wrote it: pid, host, request
        if self.writer is not None:
            out["writer_process"] = {"fate": self.writer.fate.value, "why": self.writer.why}
        if self.header is not None:
            h = self.header
            out.update(
                tokens=h.num_tokens,
                layers=h.num_layers,
                hidden=h.hidden_size,
                dtype=h.hidden.dtype,
            )
        if self.checksum_verified:
            out["checksum_verified"] = True
        return out


def _examine(path: str, options: LoadOptions) -> tuple[SampleHeader | None, SampleError | None]:
    """The header and what the loader would refuse, by the loader's own rule."""
    try:
        with open_sample(path) as fd:
            return examine(fd, path, options)
    except (CorruptSampleError, IncompleteSampleError) as exc:  # not a regular file
        return None, exc


def _header_only(path: str) -> tuple[SampleHeader | None, SampleError | None]:
    try:
        return read_header(path), None
    except (CorruptSampleError, IncompleteSampleError) as exc:
        return None, exc


def _age(now: float, *mtimes: float | None) -> float | None:
    known = [m for m in mtimes if m is not None]
    return max(0.0, now - max(known)) if known else None


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def check_sample(
    root: str | os.PathLike[str],
    name: str,
    *,
    checksums: bool = False,
    grace: float = GRACE,
    now: float | None = None,
    options: LoadOptions | None = None,
) -> SampleHealth:
    """Classify one sample without blocking.

    The lock is probed first and the data file looked at second; with this order a
    writer that publishes before it releases its lock (every writer of this format)
    can never be mistaken for a dead one.

    Args:
        root: The storage directory.
        name: The sample's data-file name, ``NAME.safetensors`` (its lock-file name is
            accepted too).
        checksums: Also read the tensor data and check the writer's CRC32, if recorded
            (``options`` with ``verify_checksum``).
        grace: Seconds during which a released lock without data, or a truncated file
            without a lock, still counts as ``pending`` (see ``GRACE``).
        now: The current time (``time.time()``); for tests.
        options: How a reader would load the file (default: ``LoadOptions()``, the
            reader's defaults). The file is ``ready`` exactly when a reader with these
            options would yield it: the content checks are the loader's own
            (``sample.content``); only the tensors are not built.

    Returns:
        The verdict. A file that cannot be read (permissions, I/O error) is ``corrupt``
        with the error as the reason.

    Raises:
        ValueError: ``name`` is not a sample or lock file name.
        FileNotFoundError: Neither the data file nor the lock file exists (the sample was
            consumed or removed meanwhile).
    """
    root = os.fspath(root)
    key = sample_key(os.path.basename(name))
    if key is None:
        raise ValueError(f"{name!r} is not a sample name (expected NAME{DATA_SUFFIX})")
    data_path = os.path.join(root, os.path.dirname(name), key)
    try:
        load = options or LoadOptions()
        if checksums and not load.verify_checksum:
            load = dataclasses.replace(load, verify_checksum=True)
        return _check_sample(data_path, key, load, grace, time.time() if now is None else now)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return SampleHealth(key, data_path, SampleState.CORRUPT, f"cannot read: {exc}")


def _check_sample(
    data_path: str, name: str, options: LoadOptions, grace: float, now: float
) -> SampleHealth:
    lock_file = lock_path(data_path)
    lock = probe(lock_file)
    lock_mtime = _mtime(lock_file) if lock is not LockState.ABSENT else None
    try:
        st = os.stat(data_path)
    except FileNotFoundError:
        st = None
    data_mtime = st.st_mtime if st is not None else None
    status = read_status(lock_file) if lock is not LockState.ABSENT else None
    header: SampleHeader | None = None
    problem: SampleError | None = None
    if st is not None and lock is not LockState.HELD:
        # A held lock is pending whatever the file holds: leave it to its writer.
        header, problem = _examine(data_path, options)
    elif st is not None:
        header, problem = _header_only(data_path)
    verified = bool(
        problem is None
        and header is not None
        and options.verify_checksum
        and Meta.CRC32 in header.metadata
    )
    obs = observe(
        lock,
        status,
        _age(now, lock_mtime),
        data_exists=st is not None,
        data_age=_age(now, data_mtime),
        problem=problem,
        num_tokens=header.num_tokens if header is not None else None,
    )
    try:
        verdict = judge(obs, grace)
    except FileNotFoundError:
        raise FileNotFoundError(f"{data_path}: neither the data file nor its lock exists") from None
    reason = verdict.reason
    ready = verdict.state is SampleState.READY and header is not None
    if ready and header is not None and header.metadata.get(Meta.NONFINITE) == "1":
        reason = "hidden states contain NaN or inf"
    return SampleHealth(
        name,
        data_path,
        verdict.state,
        reason,
        header=header,
        lock=lock,
        lock_status=status,
        size=st.st_size if st is not None else None,
        age=_age(now, lock_mtime, data_mtime),
        checksum_verified=verified,
        writer=obs.writer,
    )


def temp_owner_lock(temp_file: str) -> str | None:
    """The lock file whose holder owns a temporary file, or None if none can.

    A data temp file ``NAME.safetensors.tmp.<id>`` is protected by the sample's lock
    ``NAME.safetensors.lock``. A lock file being created,
    ``NAME.safetensors.lock.tmp.<id>``, is locked itself before it is renamed into place,
    so it is its own lock.

    Args:
        temp_file: Path (or name) of the temporary file.

    Returns:
        The path of the lock to probe, in the same directory as ``temp_file``.
    """
    final = temp_file.rsplit(TEMP_INFIX, 1)[0]
    if final.endswith(DATA_SUFFIX + LOCK_SUFFIX):
        return temp_file
    if final.endswith(DATA_SUFFIX):
        return lock_path(final)
    return None


def check_temp(
    root: str | os.PathLike[str],
    name: str,
    *,
    grace: float = GRACE,
    now: float | None = None,
) -> SampleHealth:
    """Classify a temporary file (``NAME.safetensors.tmp.<pid>.<rand>``) without blocking.

    Rule: a temporary file is an orphan when the lock that protects it (see
    ``temp_owner_lock``) is not held *and* either that lock names a writer known to be
    gone (it ran on this host: ``check_writer``; at once, ``writer`` says so) or the file
    has not been modified for ``grace`` seconds. A held lock means its writer is alive
    (the kernel releases ``flock`` locks of dead processes); a recent modification means
    a lock-less writer may still be writing. Otherwise it is ``pending``.

    Args:
        root: The storage directory.
        name: The temporary file's name.
        grace: Seconds of inactivity after which an unprotected temporary is an orphan.
        now: The current time (``time.time()``); for tests.

    Returns:
        ``orphan_temp`` or ``pending``, with ``is_temp`` set.

    Raises:
        ValueError: ``name`` is not a temporary file name.
        FileNotFoundError: The file is gone (published or removed meanwhile).
    """
    if classify(os.path.basename(name)) is not Kind.TEMP:
        raise ValueError(f"{name!r} is not a temporary file name (NAME{TEMP_INFIX}<id>)")
    path = os.path.join(os.fspath(root), name)
    now = time.time() if now is None else now
    owner = temp_owner_lock(path)
    try:
        lock = probe(owner) if owner is not None else LockState.ABSENT
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        lock = LockState.ABSENT
    st = os.stat(path)
    age = max(0.0, now - st.st_mtime)
    base = os.path.basename(name)
    lock_name = os.path.basename(owner or "")
    # A free lock names the writer that held it: one known gone never finishes the file.
    writer = check_writer(read_status(owner)) if owner and lock is LockState.FREE else None

    def verdict(state: SampleState, reason: str) -> SampleHealth:
        return SampleHealth(base, path, state, reason, lock=lock, size=st.st_size, age=age,
                            is_temp=True, writer=writer)  # fmt: skip

    if lock is LockState.HELD:
        return verdict(SampleState.PENDING, f"being written: {lock_name} is held")
    if writer is not None and writer.fate is WriterFate.GONE:
        return verdict(SampleState.ORPHAN_TEMP, f"abandoned: its lock is free and {writer.why}")
    if age < grace:
        return verdict(SampleState.PENDING, f"modified {age:.1f}s ago; may still be written")
    what = "no lock protects it" if lock is LockState.ABSENT else "its lock is not held"
    return verdict(SampleState.ORPHAN_TEMP, f"{what} and it is unchanged for {age:.0f}s")


def scan_health(
    root: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    *,
    checksums: bool = False,
    grace: float = GRACE,
    include_temps: bool = True,
    options: LoadOptions | None = None,
) -> Iterator[SampleHealth]:
    """Check every sample (and temporary file) of a storage directory.

    The directory is listed once; entries that vanish before they are looked at
    (consumed by a reader, published under their final name) are left out.

    Args:
        root: The storage directory.
        progress: Called as ``progress(done, total)`` after each entry.
        checksums: Verify recorded CRC32s (reads all tensor data).
        grace: See ``check_sample`` and ``check_temp``.
        include_temps: Also report temporary files (after the samples).
        options: How a reader would load the files (see ``check_sample``).

    Yields:
        One ``SampleHealth`` per sample, in natural name order, then one per temporary
        file.

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.
    """
    root = os.fspath(root)
    samples, temps = list_entries(root)
    if not include_temps:
        temps = []
    total = len(samples) + len(temps)
    now = time.time()
    checks: list[Callable[[], SampleHealth]] = []
    checks += [
        functools.partial(
            check_sample, root, name, checksums=checksums, grace=grace, now=now, options=options
        )
        for name in samples
    ]
    checks += [functools.partial(check_temp, root, name, grace=grace, now=now) for name in temps]
    for done, check in enumerate(checks, 1):
        try:
            result: SampleHealth | None = check()
        except FileNotFoundError:
            result = None  # vanished since the listing: consumed or published meanwhile
        if progress is not None:
            progress(done, total)
        if result is not None:
            yield result


def count_states(results: Iterable[SampleHealth]) -> dict[str, int]:
    """Count entries per state, in ``SampleState`` order, leaving out zero counts."""
    counts = Counter(r.state for r in results)
    return {s.value: counts[s] for s in SampleState if counts[s]}


__all__ = [
    "PROBLEM_STATES",
    "ProgressCallback",
    "SampleHealth",
    "check_sample",
    "check_temp",
    "count_states",
    "scan_health",
    "temp_owner_lock",
]
