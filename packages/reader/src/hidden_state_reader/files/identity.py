"""Process identity: who this process is, as locks, claims and records name it.

One home for the identity every writer and consumer records: the host name and pid
(``process_label``, ``process_record``), and, where ``/proc`` exists, the kernel's boot
id, the PID namespace and the process start time (``/proc/PID/stat`` field 22), which a
lock's ``writing`` status carries (``writer_identity``). With them ``check_writer`` can
tell, on the writer's own host, that a writer is gone at once (even if its pid was
reused); elsewhere, or for a lock without them (older writers, vLLM's empty locks), it
says so and the grace period decides (``hidden_state_reader.sample.states``).
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from hidden_state_reader.format.lock_status import LockStatus


def host_name() -> str:
    """This host's name, as every record of this package names it."""
    return socket.gethostname()


def process_label() -> str:
    """``host:pid`` of the calling process (who consumed a key, who holds a claim)."""
    return f"{host_name()}:{os.getpid()}"


def unique_token(nonce_chars: int = 32) -> str:
    """``host:pid:nonce``: the calling process, told apart from its other holders."""
    return f"{process_label()}:{uuid.uuid4().hex[:nonce_chars]}"


def process_record() -> dict[str, Any]:
    """``{"host", "pid"}`` of the calling process, for JSON records (members, producers)."""
    return {"host": host_name(), "pid": os.getpid()}


_PROC = "/proc"


def _read_proc(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


@functools.cache
def _boot_id() -> str | None:
    """The running kernel's boot id (None where there is no /proc)."""
    return _read_proc(f"{_PROC}/sys/kernel/random/boot_id")


def _pid_namespace() -> str | None:
    """This process's PID namespace, e.g. ``pid:[4026531836]`` (None without /proc)."""
    try:
        return os.readlink(f"{_PROC}/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessSeen:
    """What ``/proc/PID/stat`` says of a live pid: its start time and whether it is a zombie."""

    start_ticks: int
    zombie: bool


def process_seen(pid: int) -> ProcessSeen | None:
    """Look up ``pid`` in ``/proc``; None when no such process exists (or no /proc)."""
    raw = _read_proc(f"{_PROC}/{pid}/stat")
    if raw is None:
        return None
    # "PID (COMM) STATE ..." where COMM may hold spaces and parentheses: split after the
    # last ")"; field 3 (state) is then the first and field 22 (starttime) the 20th.
    fields = raw[raw.rfind(")") + 1 :].split()
    try:
        return ProcessSeen(int(fields[19]), fields[0] in ("Z", "X"))
    except (IndexError, ValueError):
        return None


def writer_identity() -> dict[str, Any]:
    """Who the calling process is, as a lock records it.

    ``pid`` and ``host`` always; where ``/proc`` exists also ``boot_id`` (the running
    kernel), ``pid_ns`` (the PID namespace, so a container's pids are not looked up in
    another's) and ``start_ticks`` (the process start time in clock ticks after boot,
    ``/proc/PID/stat`` field 22: a reused pid has another one).
    """
    return {"pid": os.getpid(), "host": host_name(), **_process_facts(os.getpid())}


@functools.cache
def _process_facts(pid: int) -> dict[str, Any]:
    """``boot_id``, ``pid_ns`` and ``start_ticks`` of this process; {} without ``/proc``.

    Looked up once per pid: a forked child is another pid, with its own start time.
    """
    boot, pid_ns, seen = _boot_id(), _pid_namespace(), process_seen(pid)
    if boot is None or pid_ns is None or seen is None:
        return {}
    return {"boot_id": boot, "pid_ns": pid_ns, "start_ticks": seen.start_ticks}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host could still be writing (a zombie cannot).

    ``True`` where that cannot be told (another user's process, no ``/proc``).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    seen = process_seen(pid)
    return seen is None or not seen.zombie


class WriterFate(enum.Enum):
    """What can be known about the process that wrote a lock's ``writing`` status."""

    RUNNING = "running"
    """It ran on this host and is still running."""
    GONE = "gone"
    """It ran on this host and is gone (exited, killed, or its pid reused): it will never
    publish the sample."""
    ELSEWHERE = "elsewhere"
    """It ran on another host (or in another PID namespace): it cannot be checked here."""
    UNKNOWN = "unknown"
    """The lock does not say which process wrote it (an older writer, vLLM's lock)."""


@dataclass(frozen=True)
class WriterCheck:
    """The fate of a lock's writer and how it was told, in a few words (``why``)."""

    fate: WriterFate
    why: str


def check_writer(status: LockStatus | None) -> WriterCheck:
    """What can be known, from here, about the writer that left ``status`` in a lock.

    On the writer's own host (same boot id and PID namespace) its pid is looked up in
    ``/proc``: gone, a zombie, or a process with another start time means the writer is
    gone. Another boot id is another host (or this one before a restart: host names are
    no proof, containers on several nodes share them), so the grace period decides.
    """
    detail = status.detail if status is not None else {}
    pid, host = detail.get("pid"), detail.get("host")
    boot, pid_ns, ticks = detail.get("boot_id"), detail.get("pid_ns"), detail.get("start_ticks")
    if not (isinstance(pid, int) and isinstance(boot, str) and isinstance(ticks, int)):
        why = "the lock does not record its writer's process (an older writer, or vLLM's)"
        return WriterCheck(WriterFate.UNKNOWN, why)
    if boot != _boot_id():
        return WriterCheck(
            WriterFate.ELSEWHERE, f"its writer (pid {pid}) ran on host {host}: not checkable here"
        )
    if pid_ns != _pid_namespace():
        why = f"its writer (pid {pid}) ran in another PID namespace of this host: not checkable"
        return WriterCheck(WriterFate.ELSEWHERE, why)
    seen = process_seen(pid)
    if seen is None or seen.zombie:
        return WriterCheck(WriterFate.GONE, f"its writer (pid {pid} on this host) is gone")
    if seen.start_ticks != ticks:
        why = f"its writer (pid {pid} on this host) is gone; the pid now names another process"
        return WriterCheck(WriterFate.GONE, why)
    return WriterCheck(WriterFate.RUNNING, f"its writer (pid {pid} on this host) is running")
