"""What earlier runs left in an output directory, and what this run must still do.

An interrupted or killed run leaves three kinds of traces, each handled here:

* manifest records: ``plan`` skips the samples they settle (ok with the file present,
  or failed unless retried);
* sample files written but never recorded: ``recover`` verifies each one under its lock
  and keeps it, or deletes it so that the sample is redone (never trusted unverified);
* temporary files of writers killed mid-write: ``remove_stale_temp_files``.
"""

from __future__ import annotations

import contextlib
import logging
import os

from hidden_state_connector.apps.offline.manifest import (
    FILE_PREFIX,
    STATUS_FAILED,
    STATUS_OK,
    Manifest,
    SampleRecord,
    sample_name,
)
from hidden_state_connector.apps.offline.result import ExtractResult
from hidden_state_connector.apps.offline.sample_check import verify_file
from hidden_state_connector.apps.offline.settings import ExtractOptions
from hidden_state_reader.files.identity import pid_alive

log = logging.getLogger(__name__)

RECOVER_LOCK_TIMEOUT = 30.0
"""Seconds to wait for a writer still holding a file found on disk (then it is redone)."""


def plan(manifest: Manifest, total: int, *, retry_failed: bool, result: ExtractResult) -> bytearray:
    """Mark the indices this run must handle; count the others as skipped.

    Args:
        manifest: The output directory's manifest.
        total: Records in the input.
        retry_failed: Handle samples recorded as failed again.
        result: Gets ``skipped_ok``, ``skipped_failed`` and ``todo``.

    Returns:
        One byte per index: 1 for the samples to handle.
    """
    wanted = bytearray(total)
    for index in range(total):
        record = manifest.samples.get(index)
        if record is not None and record.ok:
            if os.path.exists(os.path.join(manifest.directory, record.file or sample_name(index))):
                result.skipped_ok += 1
                continue
        elif record is not None and record.status == STATUS_FAILED and not retry_failed:
            result.skipped_failed += 1
            continue
        wanted[index] = 1
    result.todo = sum(wanted)
    return wanted


def recover(
    index: int,
    path: str,
    prompt: list[int],
    options: ExtractOptions,
    result: ExtractResult,
    loss_mask: list[int] | None = None,
) -> SampleRecord | None:
    """Verify a file found on disk for an unrecorded sample; keep it or delete it.

    Args:
        index: The sample.
        path: Its file.
        prompt: Its prompt's token ids.
        options: The run's options (layers, output tokens).
        result: ``redone`` counts the files deleted here.
        loss_mask: The mask the file must hold for the prompt (None: none).

    Returns:
        The sample's ok record, or None to redo it (a writer still holds the file, and
        the new file replaces it; or the file did not check out and is deleted).
    """
    from hidden_state_reader.files.locks import SharedLock

    lock = SharedLock.acquire(path, timeout=RECOVER_LOCK_TIMEOUT)
    if lock is None:
        return None
    try:
        tokens, nbytes = verify_file(
            path,
            prompt,
            layer_ids=options.captured_layers,
            include_output=options.include_output_tokens,
            loss_mask=loss_mask,
        )
    except Exception as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        result.redone += 1
        log.info("sample %d: %s does not check out (%s); redoing it", index, path, exc)
        return None
    finally:
        lock.release()
    return SampleRecord(index, STATUS_OK, sample_name(index), tokens, len(prompt), nbytes)


def remove_stale_temp_files(directory: str) -> int:
    """Delete ``hs_*`` temporary files (``*.tmp.<pid>.<id>``) left by dead writers.

    Returns:
        How many were removed.
    """
    removed = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if not name.startswith(FILE_PREFIX) or ".tmp." not in name:
                continue
            pid_text = name.rsplit(".tmp.", 1)[1].split(".", 1)[0]
            if pid_text.isdigit() and pid_alive(int(pid_text)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed
