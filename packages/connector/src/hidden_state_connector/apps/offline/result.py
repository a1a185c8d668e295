"""``ExtractResult``: what one extraction run did (for the summary and the exit status)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hidden_state_connector.apps.offline.manifest import MANIFEST_NAME


@dataclass
class ExtractResult:
    """What a run did (for the summary and the exit status).

    Attributes:
        out_dir: The output directory (absolute).
        input_description: What the input was.
        total: Records considered (after ``limit``).
        todo: Records this run had to handle.
        skipped_ok: Already ok in the manifest.
        skipped_failed: Recorded as failed earlier and not retried.
        ok: Ok samples this run (computed + recovered).
        computed: Ok samples written by vLLM in this run.
        recovered: Ok samples whose files were already there (verified, not recomputed).
        redone: Files found on disk that failed verification and were redone.
        failures: ``(index, reason)`` of every sample that failed in this run.
        tokens: Tokens in the computed files.
        bytes: Bytes of the computed files.
        engine_seconds: Time from vLLM ready to the last computed sample.
        wall_seconds: Time of the whole run.
        engine_started: Whether vLLM was started.
        interrupted: The run was stopped (Ctrl-C) before the end.
        error: Why the run stopped early (vLLM failed); samples in flight are redone by
            the next run.
    """

    out_dir: str
    input_description: str = ""
    total: int = 0
    todo: int = 0
    skipped_ok: int = 0
    skipped_failed: int = 0
    ok: int = 0
    computed: int = 0
    recovered: int = 0
    redone: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)
    tokens: int = 0
    bytes: int = 0
    engine_seconds: float = 0.0
    wall_seconds: float = 0.0
    engine_started: bool = False
    interrupted: bool = False
    error: str | None = None

    @property
    def nothing_to_do(self) -> bool:
        """Every record was already handled by earlier runs."""
        return self.todo == 0

    @property
    def manifest_path(self) -> str:
        """Where the manifest is."""
        return os.path.join(self.out_dir, MANIFEST_NAME)
