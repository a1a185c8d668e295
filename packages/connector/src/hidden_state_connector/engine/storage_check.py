"""Can this process write samples into a directory? Asked once at start-up, and cached.

The connector needs four things of a storage directory: create a file in it, ``flock``
that file, rename it, and remove it (the lock protocol and the atomic publish of
``hidden_state_reader.format`` do exactly these). ``probe`` does all four on a throw-away
file whose name readers ignore (a temporary name of the format, ``*.safetensors.tmp.*``)
and removes it again; nothing is written into the file, so a full disk does not stop
a server from starting (the writer copes with that later, sample by sample).

* ``check_storage_root`` runs at start-up (``HiddenStateConnector.__init__``): it creates
  ``shared_storage_path`` if missing, probes it, and raises ``StorageRootError`` naming
  the setting, the path and the reason, so that vLLM does not start.
* ``usable_directory`` is for the scheduler's hot path (client-chosen directories with
  ``allow_custom_save_path``): it creates nothing, probes each distinct directory at
  most once per ``PROBE_TTL_S`` seconds, and returns the reason a directory cannot be
  used, or None.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from hidden_state_reader.files.fileio import nearest_existing
from hidden_state_reader.format import DATA_SUFFIX, temp_path

SETTING = "shared_storage_path"
# The probe file's name before ``temp_path`` makes it unique and temporary.
PROBE_STEM = "hidden-state-connector-probe"
# ``usable_directory`` answers from its cache for this long (seconds).
PROBE_TTL_S = 10.0
# At most this many directories are remembered (client-chosen paths are unbounded).
PROBE_CACHE_SIZE = 4096


class StorageRootError(ValueError):
    """``shared_storage_path`` cannot be used; vLLM must not start.

    Attributes:
        path: The configured path, as given.
        reason: Why it cannot be used.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"{SETTING}: cannot write hidden states to {path!r}: {reason}. Set "
            f"kv_connector_extra_config.{SETTING} to a directory this process can create "
            "files in (vLLM does not start until then)."
        )


def _describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def _first_non_directory(path: str) -> str | None:
    """The first existing component of ``path`` (itself included) that is not a directory."""
    current = os.sep
    for part in path.split(os.sep):
        if not part:
            continue
        current = os.path.join(current, part)
        try:
            if not os.path.isdir(current):
                return current if os.path.lexists(current) else None
        except OSError:
            return None
    return None


def probe(directory: str) -> str | None:
    """Create, ``flock``, rename and remove a temporary file in an existing directory.

    Args:
        directory: An absolute path.

    Returns:
        None if all four worked, else the reason (which step failed and the OS error).
        The temporary file is removed in either case (best effort after a failure).
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return "it is not a directory"
        return f"cannot open it: {_describe(exc)}"
    first = os.path.basename(temp_path(PROBE_STEM + DATA_SUFFIX))
    second = os.path.basename(temp_path(PROBE_STEM + DATA_SUFFIX))
    current: str | None = None
    step = "create a file in it"
    try:
        fd = os.open(first, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        current = first
        try:
            step = "flock a file in it"
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        step = "rename a file in it"
        os.replace(first, second, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        current = second
        step = "remove a file from it"
        os.unlink(second, dir_fd=dir_fd)
        current = None
    except OSError as exc:
        return f"cannot {step}: {_describe(exc)}"
    finally:
        if current is not None:
            with contextlib.suppress(OSError):
                os.unlink(current, dir_fd=dir_fd)
        os.close(dir_fd)
    return None


def check_storage_root(path: str) -> str:
    """Make sure ``shared_storage_path`` is a directory samples can be written to.

    Creates the directory (and its parents) if it does not exist, then probes it.

    Args:
        path: The configured ``shared_storage_path``.

    Returns:
        The absolute path of the directory.

    Raises:
        StorageRootError: It is not (and cannot be made) such a directory; the message
            names ``shared_storage_path``, the path and the reason.
    """
    root = os.path.abspath(path)
    blocker = _first_non_directory(root)
    if blocker == root:
        raise StorageRootError(path, "it exists and is not a directory")
    if blocker is not None:
        raise StorageRootError(path, f"{blocker!r} exists and is not a directory")
    if not os.path.isdir(root):
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise StorageRootError(
                path, f"it does not exist and cannot be created: {_describe(exc)}"
            ) from exc
    reason = probe(root)
    if reason is not None:
        raise StorageRootError(path, reason)
    return root


def _uncached_reason(directory: str) -> str | None:
    blocker = _first_non_directory(directory)
    if blocker is not None:
        return "it is not a directory" if blocker == directory else f"{blocker} is not a directory"
    existing = nearest_existing(directory)
    reason = probe(existing)
    if reason is None or existing == directory:
        return reason
    return f"it does not exist and cannot be created in {existing}: {reason}"


class DirectoryProbeCache:
    """Answers ``usable_directory`` questions, probing each directory once per ``ttl``.

    Thread-safe; bounded to ``max_entries`` directories (least recently asked go first).

    Args:
        ttl: Seconds an answer is reused.
        max_entries: Directories remembered at most.
        clock: Monotonic time source (seconds).
    """

    def __init__(
        self,
        ttl: float = PROBE_TTL_S,
        max_entries: int = PROBE_CACHE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self.probes = 0
        self._answers: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        self._mutex = threading.Lock()

    def usable_directory(self, path: str) -> str | None:
        """Why samples cannot be written into ``path``, or None if they can.

        A directory that does not exist yet is usable if its nearest existing ancestor
        is (the writer creates the missing levels); nothing is created here.

        Args:
            path: A directory (not a sample's file path).

        Returns:
            None, or the reason, for a client-facing ``hidden_states_error``.
        """
        key = os.path.abspath(path)
        now = self.clock()
        with self._mutex:
            hit = self._answers.get(key)
            if hit is not None and now - hit[0] < self.ttl:
                self._answers.move_to_end(key)
                return hit[1]
            reason = _uncached_reason(key)
            self.probes += 1
            self._answers[key] = (now, reason)
            self._answers.move_to_end(key)
            while len(self._answers) > self.max_entries:
                self._answers.popitem(last=False)
            return reason

    def forget(self) -> None:
        """Drop every cached answer (the next question probes again)."""
        with self._mutex:
            self._answers.clear()


_DEFAULT_CACHE = DirectoryProbeCache()


def usable_directory(path: str) -> str | None:
    """Why samples cannot be written into directory ``path``, or None if they can.

    For the scheduler's hot path: each distinct directory is probed (create, ``flock``,
    rename and remove a temporary file) at most once per ``PROBE_TTL_S`` seconds in this
    process; other calls are a dictionary look-up. Creates nothing; a missing directory
    is judged by its nearest existing ancestor.

    Args:
        path: A directory (pass ``os.path.dirname`` of a sample path).

    Returns:
        None if the directory is usable, else the reason.
    """
    return _DEFAULT_CACHE.usable_directory(path)
