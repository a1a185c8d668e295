"""The offline extraction loop: dataset -> vLLM (+ HiddenStateConnector) -> verified files.

For every input record ``i`` the file ``DIR/hs_{i}.safetensors`` is requested through
``kv_transfer_params["hidden_states_path"]``. A sample is recorded in ``manifest.jsonl``
only once its file is final (the writer released the lock) and its header and token ids
check out, so the manifest never claims more than the disk holds:

1. Records already ``ok`` in the manifest (with their file present) are skipped, and so
   are ``failed`` ones unless ``retry_failed``. With nothing left, vLLM is not started.
2. Each remaining record is tokenized here (so token counts are known); invalid records
   and prompts longer than ``max_model_len - 1`` are recorded as failed without being
   sent. A file already on disk for an unrecorded index (a killed run) is verified and
   kept, or deleted and redone: a file is never trusted unverified.
3. Up to ``batch_size`` requests are kept in flight; as each finishes, a verifier thread
   waits on its lock, checks the file and hands the outcome to the loop, which appends it
   to the manifest.

This module runs it: the checks, the run lock, the manifest's start and end events,
the progress line and Ctrl-C. The pieces live beside it: ``settings``
(``ExtractOptions``, vLLM and connector settings), ``result`` (``ExtractResult``),
``resume`` (what earlier runs left behind), ``pipeline`` (steps 2 and 3), ``engine``
(``VllmEngine``), ``check_pool`` (the verifier threads) and ``sample_check`` (``verify_file``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from hidden_state_connector.apps.offline.errors import UsageError, first_line
from hidden_state_connector.apps.offline.inputs import InputSource, open_input
from hidden_state_connector.apps.offline.manifest import Manifest, RunLock
from hidden_state_connector.apps.offline.pipeline import Pipeline
from hidden_state_connector.apps.offline.progress import ExtractCounters
from hidden_state_connector.apps.offline.result import ExtractResult
from hidden_state_connector.apps.offline.resume import plan, remove_stale_temp_files
from hidden_state_connector.apps.offline.settings import (
    ExtractOptions,
    check_compatible,
    check_engine_args,
    check_reserved,
    connector_settings,
    run_settings,
)

__all__ = ["Extraction", "run_extract"]

log = logging.getLogger(__name__)


class Extraction:
    """One run of ``hidden-state extract`` (see the module docstring).

    Args:
        options: What to do.
        stream: Where progress and notes go (stderr).
    """

    def __init__(self, options: ExtractOptions, stream: TextIO | None = None) -> None:
        self.options = options
        self.stream = stream or sys.stderr
        self.out = os.path.abspath(options.out_dir)
        self.result = ExtractResult(out_dir=self.out)
        self.manifest: Manifest | None = None
        self.progress: ExtractCounters | None = None
        self.pipeline: Pipeline | None = None
        self._sigint = False

    def note(self, message: str) -> None:
        """A line on the progress stream."""
        if self.progress is not None:
            self.progress.break_line()
        print(f"extract: {message}", file=self.stream, flush=True)

    def run(self) -> ExtractResult:
        """Do the run.

        Raises:
            UsageError: Bad input or options (exit status 2).
            RuntimeError: vLLM could not be started or died (exit status 1).
        """
        started = time.monotonic()
        options = self.options
        if options.max_tokens < 1:
            raise UsageError("--max-tokens: vLLM needs at least 1")
        if options.batch_size < 1:
            raise UsageError("--batch-size: must be at least 1")
        connector_settings(options.connector_config, self.out)  # fail early on bad keys
        check_reserved(options.engine_args, options.capture)
        source = open_input(options.input, limit=options.limit, split=options.split)
        self.result.input_description = source.description
        self.result.total = source.total
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise UsageError(f"--out {self.out}: not a directory")
        os.makedirs(self.out, exist_ok=True)
        run_lock = RunLock.acquire(self.out)
        try:
            self.manifest = Manifest(self.out)
            if self.manifest.ignored_lines:
                self.note(
                    f"ignored {self.manifest.ignored_lines} unreadable line(s) of "
                    f"{self.manifest.path}; those samples are checked again"
                )
            settings = run_settings(options)
            check_compatible(self.manifest.last_start(), settings, self.out)
            wanted = plan(
                self.manifest, source.total, retry_failed=options.retry_failed, result=self.result
            )
            if self.result.todo:
                self._work(source, wanted, settings)
        finally:
            self._close()
            run_lock.release()
            self.result.wall_seconds = time.monotonic() - started
        return self.result

    def _work(self, source: InputSource, wanted: bytearray, settings: dict[str, Any]) -> None:
        assert self.manifest is not None
        options = self.options
        if options.engine_args:
            check_engine_args(options.engine_args)  # before any work, not at the first prompt
        removed = remove_stale_temp_files(self.out)
        if removed:
            self.note(f"removed {removed} temporary file(s) left by an interrupted run")
        self.manifest.event(
            "start",
            **settings,
            input=os.path.abspath(options.input),
            max_tokens=options.max_tokens,
            todo=self.result.todo,
            pid=os.getpid(),
        )
        self.progress = ExtractCounters(
            self.result.todo, stream=self.stream, interval=options.progress_interval
        )
        self.pipeline = Pipeline(
            options, self.out, self.manifest, self.result, self.progress, self.note
        )
        previous_handler = self._watch_sigint()
        try:
            self.pipeline.run(source.items(lambda index: bool(wanted[index])))
            self.progress.mark_engine_done()
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.note("interrupted; run the same command again to resume")
        except UsageError:
            raise
        except Exception as exc:
            log.debug("extraction failed", exc_info=True)
            if self._sigint:  # Ctrl-C also stopped vLLM's engine core, which then fails
                self.result.interrupted = True
                self.note("interrupted; run the same command again to resume")
            else:
                self.result.error = first_line(exc)
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            self.pipeline.close()
            self.progress.mark_engine_done()
            self.progress.finish()
            self.result.engine_seconds = self.progress.engine_seconds
            self.manifest.event(
                "end",
                ok=self.result.ok,
                failed=len(self.result.failures),
                computed=self.result.computed,
                recovered=self.result.recovered,
                tokens=self.result.tokens,
                bytes=self.result.bytes,
                interrupted=self.result.interrupted,
                error=self.result.error,
            )

    def _watch_sigint(self) -> Any:
        """Remember a Ctrl-C (then behave as before); returns the handler to restore."""
        if threading.current_thread() is not threading.main_thread():
            return None
        previous = signal.getsignal(signal.SIGINT) or signal.SIG_DFL  # None: set outside Python

        def handler(signum: int, frame: Any) -> None:
            self._sigint = True
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        return previous

    def _close(self) -> None:
        if self.pipeline is not None and self.pipeline.engine is not None:
            self.pipeline.engine.shutdown()
            # Writers of an earlier, killed run that were still dying at the start are gone.
            with contextlib.suppress(OSError):
                remove_stale_temp_files(self.out)
        if self.manifest is not None:
            self.manifest.close()


def run_extract(options: ExtractOptions, stream: TextIO | None = None) -> ExtractResult:
    """Run an extraction (see ``Extraction``)."""
    return Extraction(options, stream).run()
