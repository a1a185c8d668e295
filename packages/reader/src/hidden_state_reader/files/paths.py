"""Paths below a storage root: directories opened without following symlinks.

And the proof that a client-supplied sample path stays inside the root.
"""

from __future__ import annotations

import contextlib
import errno
import os

from hidden_state_reader.errors import PathOutsideRootError
from hidden_state_reader.format.names import (
    DATA_SUFFIX,
    MAX_COMPONENT_BYTES,
    MAX_PATH_BYTES,
    MAX_SUBDIR_DEPTH,
    Kind,
    classify,
)


def open_dir_beneath(root: str, relative: str, *, create: bool = False) -> int:
    """Open a directory below ``root`` one component at a time, never following a symlink.

    The returned descriptor pins the directory: files created through it (``dir_fd=``)
    land there even if someone later swaps a path component for a symlink.

    Args:
        root: The storage root (opened by path).
        relative: The directory below it (``""`` for the root itself).
        create: Create missing components.

    Returns:
        A directory descriptor (close it).

    Raises:
        PathOutsideRootError: A component is ``..``, hidden, or a symlink.
        OSError: A component cannot be opened or created.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (p for p in relative.split("/") if p and p != "."):
            if part == ".." or part.startswith("."):
                raise PathOutsideRootError(relative, root, f"component {part!r} not allowed")
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathOutsideRootError(
                        relative, root, f"component {part!r} is not a plain directory"
                    ) from exc
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def resolve_inside(root: str, requested: str) -> str:
    """Resolve a client-supplied sample path and prove it stays inside ``root``.

    Relative paths are taken relative to ``root``. The final path must end in
    ``.safetensors``, contain no NUL byte, no ``..`` or hidden component, no component
    over ``NAME_MAX`` bytes, at most ``MAX_SUBDIR_DEPTH`` directory levels below the root
    and ``MAX_PATH_BYTES`` in all, and its parent directory (after following symlinks) must lie
    inside ``root`` (after following symlinks). The file itself may not be a symlink.

    Args:
        root: The storage root.
        requested: The path a client asked for.

    Returns:
        The absolute path to write.

    Raises:
        PathOutsideRootError: The path is refused; the message says why.
    """
    if not isinstance(requested, str) or not requested:
        raise PathOutsideRootError(str(requested), root, "empty or not a string")
    if "\x00" in requested:
        raise PathOutsideRootError(requested, root, "contains a NUL byte")
    parts = requested.replace("\\", "/").split("/")
    if ".." in parts:
        raise PathOutsideRootError(requested, root, "contains a '..' component")
    if any(p.startswith(".") for p in parts if p):
        # Hidden folders hold the readers' bookkeeping and are never scanned.
        raise PathOutsideRootError(requested, root, "a path component starts with '.'")
    if any(len(p.encode()) > MAX_COMPONENT_BYTES for p in parts):
        raise PathOutsideRootError(requested, root, "a path component is too long")
    if not requested.endswith(DATA_SUFFIX):
        raise PathOutsideRootError(requested, root, f"must end in {DATA_SUFFIX}")
    name = os.path.basename(requested)
    if classify(name) is not Kind.DATA:
        raise PathOutsideRootError(requested, root, "not a valid sample file name")
    real_root = os.path.realpath(root)
    candidate = requested if os.path.isabs(requested) else os.path.join(real_root, requested)
    parent = os.path.realpath(os.path.dirname(candidate))
    if os.path.commonpath([real_root, parent]) != real_root:
        raise PathOutsideRootError(requested, root, "resolves outside the storage root")
    rel = os.path.relpath(parent, real_root)
    if rel != "." and rel.count(os.sep) + 1 > MAX_SUBDIR_DEPTH:
        raise PathOutsideRootError(
            requested, root, f"more than {MAX_SUBDIR_DEPTH} directory levels below the root"
        )
    final = os.path.join(parent, name)
    if len(final.encode()) > MAX_PATH_BYTES:
        raise PathOutsideRootError(requested, root, "the path is too long")
    if os.path.islink(final):
        raise PathOutsideRootError(requested, root, "the target is a symlink")
    return final
