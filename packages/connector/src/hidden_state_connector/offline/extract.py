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
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import inspect
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from hidden_state_connector.config import ConnectorConfig
from hidden_state_connector.offline.errors import UsageError
from hidden_state_connector.offline.inputs import (
    InputSource,
    Prompt,
    PromptEncoder,
    RawItem,
    load_tokenizer,
    open_input,
)
from hidden_state_connector.offline.manifest import (
    FILE_PREFIX,
    MANIFEST_NAME,
    STATUS_FAILED,
    STATUS_OK,
    Manifest,
    RunLock,
    SampleRecord,
    sample_name,
)
from hidden_state_connector.offline.progress import Progress
from hidden_state_connector.server import kv_transfer_config, speculative_config

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 512 * 1024**2
RESERVED_ENGINE_ARGS = {
    "model": "the MODEL argument",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "speculative_config": "--layers",
    "kv_transfer_config": "--connector-config",
}
ENCODE_CHUNK = 64  # records tokenized at a time (keeps vLLM fed while tokenizing)


@dataclass
class ExtractOptions:
    """Everything one extraction run needs.

    Attributes:
        model: Model directory or Hugging Face name.
        input: JSONL / JSON file or ``save_to_disk`` folder.
        out_dir: Output directory (the connector's storage root).
        layers: Layer ids to capture (as configured; captured in ascending order).
        max_tokens: Tokens to generate per request (1 = prefill only).
        include_output_tokens: Also store the generated tokens (but the last).
        batch_size: Requests kept in flight in vLLM.
        max_model_len: vLLM's ``max_model_len`` (None: the model's).
        dtype: vLLM's ``dtype``.
        limit: Only the first ``limit`` records.
        split: Split of a ``DatasetDict`` input.
        retry_failed: Retry samples the manifest records as failed.
        engine_args: Further ``vllm.LLM`` keyword arguments.
        connector_config: Further ``kv_connector_extra_config`` keys.
        lock_timeout: Seconds to wait for one file's writer.
        progress_interval: Minimum seconds between progress lines.
        verify_threads: Threads waiting on locks and verifying files.
    """

    model: str
    input: str
    out_dir: str
    layers: list[int]
    max_tokens: int = 1
    include_output_tokens: bool = False
    batch_size: int = 256
    max_model_len: int | None = None
    dtype: str = "auto"
    limit: int | None = None
    split: str | None = None
    retry_failed: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)
    connector_config: dict[str, Any] = field(default_factory=dict)
    lock_timeout: float = 600.0
    progress_interval: float = 1.0
    verify_threads: int = 4

    @property
    def captured_layers(self) -> list[int]:
        """The layer axis of the files: ascending, without repeats."""
        return sorted(set(self.layers))


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


# -- settings ---------------------------------------------------------------------------


def connector_settings(user: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of an extraction run (validated).

    Raises:
        UsageError: An unknown key, a bad value, or a key that extract must control.
    """
    known = {f.name for f in dataclasses.fields(ConnectorConfig)}
    for key in user:
        if key not in known:
            raise UsageError(
                f"--connector-config: unknown key {key!r} (known: {', '.join(sorted(known))})"
            )
    given_root = user.get("shared_storage_path")
    if given_root is not None and os.path.realpath(str(given_root)) != os.path.realpath(out_dir):
        raise UsageError("--connector-config: shared_storage_path is set by --out; leave it out")
    merged = {"allow_custom_save_path": True, "stats_interval": 0, **user}
    merged["shared_storage_path"] = out_dir
    try:
        config = ConnectorConfig.from_extra_config(merged)
    except ValueError as exc:
        raise UsageError(f"--connector-config: {exc}") from None
    for key in ("allow_custom_save_path", "use_synchronization_lock"):
        if not getattr(config, key):
            raise UsageError(f"--connector-config: {key} must stay true for extract")
    return merged


def engine_settings(options: ExtractOptions, out_dir: str, *, on_cpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments (without ``model``).

    Raises:
        UsageError: ``engine_args`` sets something extract controls.
    """
    check_reserved(options.engine_args)
    kwargs: dict[str, Any] = dict(options.engine_args)
    kwargs["dtype"] = options.dtype
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    kwargs["speculative_config"] = speculative_config(options.layers)
    kwargs["kv_transfer_config"] = kv_transfer_config(
        out_dir, connector_settings(options.connector_config, out_dir)
    )
    if on_cpu:
        kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        kwargs.setdefault("enforce_eager", True)
    # Not skip_tokenizer_init: without its tokenizer vLLM neither stops at EOS nor checks
    # token ids against the vocabulary (an out-of-range id then kills the engine core).
    return kwargs


def check_reserved(engine_args: Iterable[str]) -> None:
    """Refuse engine arguments that extract sets itself.

    Raises:
        UsageError: Naming the key and the option that sets it.
    """
    for key in engine_args:
        if key in RESERVED_ENGINE_ARGS:
            raise UsageError(
                f"--engine-args: {key!r} is set by {RESERVED_ENGINE_ARGS[key]}; leave it out"
            )


def import_vllm() -> Any:
    """The ``vllm`` module.

    Raises:
        RuntimeError: It is not installed (or fails to import); the message says what to do.
    """
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError(
            f"cannot import vLLM ({exc}); install hidden-state-connector[cuda] or [cpu]"
        ) from exc
    return vllm


def check_engine_args(engine_args: Iterable[str]) -> None:
    """Refuse keys that neither ``vllm.LLM`` nor ``vllm.EngineArgs`` accept.

    Raises:
        UsageError: Naming the first unknown key.
    """
    vllm = import_vllm()
    LLM, EngineArgs = vllm.LLM, vllm.EngineArgs  # noqa: N806 - class names
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    known |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    for key in engine_args:
        if key not in known:
            raise UsageError(f"--engine-args: unknown vLLM engine argument {key!r}")


def _model_identity(model: str) -> str:
    return os.path.realpath(model) if os.path.isdir(model) else model


def run_settings(options: ExtractOptions) -> dict[str, Any]:
    """The settings that shape the files; a resumed run must use the same ones."""
    return {
        "model": _model_identity(options.model),
        "layers": options.captured_layers,
        "include_output_tokens": options.include_output_tokens,
    }


def check_compatible(previous: dict[str, Any] | None, current: dict[str, Any], out: str) -> None:
    """Refuse to mix files of different models, layers or token kinds in one directory.

    Raises:
        UsageError: Naming the setting that differs.
    """
    if previous is None:
        return
    for key, value in current.items():
        if key in previous and previous[key] != value:
            raise UsageError(
                f"--out {out}: holds samples written with {key}={previous[key]!r}, this run "
                f"has {key}={value!r}; use another --out directory"
            )


# -- files ------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """Whether a process could still be writing (a zombie, killed but not reaped, cannot)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


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
            if pid_text.isdigit() and _pid_alive(int(pid_text)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


def read_token_ids(path: str, header: Any) -> list[int]:
    """The ``token_ids`` tensor of a sample file whose header was validated."""
    import numpy as np

    info = header.tokens
    with open(path, "rb") as f:
        f.seek(header.data_start + info.begin)
        raw = f.read(info.nbytes)
    dtype = "<i8" if info.dtype == "I64" else "<i4"
    return [int(t) for t in np.frombuffer(raw, dtype=dtype)]


def verify_file(
    path: str,
    prompt: Sequence[int],
    *,
    layer_ids: Sequence[int],
    include_output: bool,
    expected: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Check that a final sample file holds this prompt's hidden states.

    Args:
        path: The sample file.
        prompt: The prompt's token ids.
        layer_ids: The captured layers the file must record (when it records any).
        include_output: Generated tokens may follow the prompt.
        expected: The exact token ids the file must hold (when known).

    Returns:
        ``(tokens, bytes)`` of the file.

    Raises:
        ValueError: The file does not match; the message says how.
        hidden_state_reader.SampleError: The file is incomplete or corrupt.
        OSError: It cannot be read.
    """
    from hidden_state_reader.format import Meta, read_header

    header = read_header(path)
    tokens = read_token_ids(path, header)
    n = len(prompt)
    if expected is not None:
        if tokens != list(expected):
            raise ValueError(
                f"its {len(tokens)} token ids differ from the {len(expected)} expected"
            )
    elif include_output:
        if tokens[:n] != list(prompt):
            raise ValueError(f"its token ids do not start with the prompt's {n} tokens")
    elif tokens != list(prompt):
        raise ValueError(f"its {len(tokens)} token ids differ from the prompt's {n}")
    recorded = header.layer_ids
    if recorded is not None and list(recorded) != list(layer_ids):
        raise ValueError(f"it holds layers {recorded}, not {list(layer_ids)}")
    prompt_meta = header.metadata.get(Meta.NUM_PROMPT_TOKENS)
    if prompt_meta is not None and prompt_meta != str(n):
        raise ValueError(f"it records {prompt_meta} prompt tokens, not {n}")
    return len(tokens), header.file_size


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# -- the engine -------------------------------------------------------------------------


Finished = tuple[int, Any, "str | None"]
"""``(index, RequestOutput or None, error or None)`` from an engine step."""


class VllmEngine:
    """A ``vllm.LLM`` fed one request at a time; outputs come back as requests finish.

    Uses ``LLM.enqueue`` plus ``LLMEngine.step`` when available (continuous batching with
    a refilled queue); otherwise falls back to ``LLM.generate`` on buffered batches.

    Args:
        llm: The engine.
        sampling_params: ``index -> SamplingParams``.
    """

    def __init__(self, llm: Any, sampling_params: Any) -> None:
        self.llm = llm
        self._params = sampling_params
        self._streaming = hasattr(llm, "enqueue") and hasattr(llm, "llm_engine")
        self._ids: dict[str, int] = {}
        self._aliases: dict[str, str] = {}
        self._buffer: list[tuple[int, list[int]]] = []

    @property
    def max_model_len(self) -> int | None:
        """The engine's ``max_model_len``."""
        config = getattr(self.llm, "model_config", None) or getattr(
            getattr(self.llm, "llm_engine", None), "model_config", None
        )
        value = getattr(config, "max_model_len", None)
        return int(value) if value else None

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids must be below it)."""
        config = getattr(self.llm, "model_config", None) or getattr(
            getattr(self.llm, "llm_engine", None), "model_config", None
        )
        try:
            return int(config.get_vocab_size())  # type: ignore[union-attr]
        except Exception:
            return None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet returned."""
        return len(self._ids) if self._streaming else len(self._buffer)

    def submit(self, index: int, token_ids: list[int]) -> str | None:
        """Add a request; returns the reason when vLLM rejects it at once."""
        if not self._streaming:
            self._buffer.append((index, token_ids))
            return None
        try:
            [req_id] = self.llm.enqueue(
                [{"prompt_token_ids": token_ids}], self._params(index), use_tqdm=False
            )
        except Exception as exc:
            return f"vLLM rejected the prompt: {_reason(exc)}"
        self._ids[req_id] = index
        # vLLM >= 0.30 returns "<id>-<random>" but reports outputs under "<id>".
        head, sep, _ = req_id.rpartition("-")
        if sep and head:
            self._aliases[head] = req_id
        return None

    def step(self) -> list[Finished]:
        """Run the engine until at least one request finished (or nothing is in flight)."""
        if not self._streaming:
            return self._run_buffer()
        finished: list[Finished] = []
        engine = self.llm.llm_engine
        while self._ids and not finished:
            if not engine.has_unfinished_requests():
                lost = sorted(self._ids.values())
                self._ids.clear()
                return [(i, None, "vLLM dropped the request") for i in lost]
            for output in engine.step():
                if not getattr(output, "finished", True):
                    continue
                req_id = output.request_id
                key = req_id if req_id in self._ids else self._aliases.pop(req_id, None)
                if key is None or key not in self._ids:
                    log.warning("output for unknown request %s ignored", req_id)
                    continue
                self._aliases.pop(key.rpartition("-")[0], None)
                finished.append((self._ids.pop(key), output, None))
        return finished

    def _run_buffer(self) -> list[Finished]:
        batch, self._buffer = self._buffer, []
        if not batch:
            return []
        try:
            outputs = self._generate(batch)
            return [(i, o, None) for (i, _), o in zip(batch, outputs, strict=True)]
        except Exception:
            if len(batch) == 1:
                raise
        results: list[Finished] = []
        for item in batch:  # one bad prompt must not fail the batch: find it
            try:
                [output] = self._generate([item])
                results.append((item[0], output, None))
            except Exception as exc:
                results.append((item[0], None, f"vLLM rejected the prompt: {_reason(exc)}"))
        return results

    def _generate(self, batch: list[tuple[int, list[int]]]) -> list[Any]:
        prompts = [{"prompt_token_ids": ids} for _, ids in batch]
        params = [self._params(i) for i, _ in batch]
        return list(self.llm.generate(prompts, params, use_tqdm=False))

    def shutdown(self) -> None:
        """Stop the engine core (best effort; the files are already final)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        with contextlib.suppress(Exception):
            if core is not None:
                core.shutdown()


# -- the run ----------------------------------------------------------------------------


@dataclass
class _Job:
    index: int
    path: str
    prompt: list[int]


def _chunks(items: Iterator[RawItem], size: int) -> Iterator[list[RawItem]]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


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
        self.progress: Progress | None = None
        self.engine: VllmEngine | None = None
        self.encoder: PromptEncoder | None = None
        self.max_model_len = options.max_model_len
        self.vocab_size: int | None = None
        self._pending: collections.deque[tuple[_Job, concurrent.futures.Future[SampleRecord]]] = (
            collections.deque()
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: dict[int, _Job] = {}  # submitted to vLLM, not yet returned
        self._sigint = False

    def note(self, message: str) -> None:
        """A line on the progress stream."""
        if self.progress is not None:
            self.progress.break_line()
        print(f"extract: {message}", file=self.stream, flush=True)

    # -- entry point ---------------------------------------------------------------------

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
        check_reserved(options.engine_args)
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
            wanted = self._plan(source)
            if self.result.todo:
                self._work(source, wanted, settings)
        finally:
            self._close()
            run_lock.release()
            self.result.wall_seconds = time.monotonic() - started
        return self.result

    def _plan(self, source: InputSource) -> bytearray:
        """Mark the indices this run must handle; count the others as skipped."""
        assert self.manifest is not None
        wanted = bytearray(source.total)
        for index in range(source.total):
            record = self.manifest.samples.get(index)
            if record is not None and record.ok:
                if os.path.exists(os.path.join(self.out, record.file or sample_name(index))):
                    self.result.skipped_ok += 1
                    continue
            elif (
                record is not None
                and record.status == STATUS_FAILED
                and not self.options.retry_failed
            ):
                self.result.skipped_failed += 1
                continue
            wanted[index] = 1
        self.result.todo = sum(wanted)
        return wanted

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
        self.progress = Progress(
            self.result.todo, stream=self.stream, interval=options.progress_interval
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, options.verify_threads), thread_name_prefix="hs-extract-verify"
        )
        previous_handler = self._watch_sigint()
        try:
            items = source.items(lambda index: bool(wanted[index]))
            for chunk in _chunks(items, max(1, min(ENCODE_CHUNK, options.batch_size))):
                if self.encoder is None:
                    self.encoder = PromptEncoder(load_tokenizer(options.model, options.engine_args))
                for prompt in self.encoder.encode(chunk):
                    self._handle(prompt)
                self._collect()
            while self.engine is not None and self.engine.in_flight:
                self._step()
            self._drain()
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
                self.result.error = _reason(exc)
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._collect()
            if self.progress is not None:
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
        if self.engine is not None:
            self.engine.shutdown()
            # Writers of an earlier, killed run that were still dying at the start are gone.
            with contextlib.suppress(OSError):
                remove_stale_temp_files(self.out)
        if self.manifest is not None:
            self.manifest.close()

    # -- per sample ----------------------------------------------------------------------

    def _record(self, record: SampleRecord, *, computed: bool = True) -> None:
        assert self.manifest is not None and self.progress is not None
        self.manifest.append(record)
        if record.ok:
            self.result.ok += 1
            self.progress.add_ok(record.tokens or 0, record.bytes or 0, computed=computed)
            if computed:
                self.result.computed += 1
                self.result.tokens += record.tokens or 0
                self.result.bytes += record.bytes or 0
            else:
                self.result.recovered += 1
        else:
            self.progress.add_failed()
            self.result.failures.append((record.index, record.error or "unknown error"))
        self.progress.maybe_print()

    def _fail(self, index: int, reason: str) -> None:
        self._record(SampleRecord(index, STATUS_FAILED, error=reason))

    def _handle(self, prompt: Prompt) -> None:
        index = prompt.index
        if prompt.error is not None or prompt.token_ids is None:
            self._fail(index, prompt.error or "no prompt")
            return
        path = os.path.join(self.out, sample_name(index))
        if os.path.lexists(path) and self._recover(index, path, prompt.token_ids):
            return
        if self._too_long(index, prompt.token_ids):
            return
        if self.engine is None:
            self.engine = self._start_engine()
            if self._too_long(index, prompt.token_ids):
                return
        top = max(prompt.token_ids)
        if self.vocab_size is not None and top >= self.vocab_size:
            self._fail(index, f"token id {top} is out of vocabulary (size {self.vocab_size})")
            return
        error = self.engine.submit(index, prompt.token_ids)
        if error is not None:
            self._fail(index, error)
            return
        self._jobs[index] = _Job(index, path, prompt.token_ids)
        while self.engine.in_flight >= self.options.batch_size:
            self._step()

    def _too_long(self, index: int, token_ids: list[int]) -> bool:
        if self.max_model_len is None:
            return False
        limit = self.max_model_len - 1
        if len(token_ids) > limit:
            self._fail(
                index,
                f"prompt has {len(token_ids)} tokens, more than max_model_len - 1 = {limit}",
            )
            return True
        return False

    def _recover(self, index: int, path: str, prompt: list[int]) -> bool:
        """Verify a file found on disk for an unrecorded sample; keep it or delete it."""
        from hidden_state_reader.format import SharedLock

        lock = SharedLock.acquire(path, timeout=30.0)
        if lock is None:
            return False  # a writer still holds it: redo (the new file replaces it)
        try:
            tokens, nbytes = verify_file(
                path,
                prompt,
                layer_ids=self.options.captured_layers,
                include_output=self.options.include_output_tokens,
            )
        except Exception as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.result.redone += 1
            log.info("sample %d: %s does not check out (%s); redoing it", index, path, exc)
            return False
        finally:
            lock.release()
        name = sample_name(index)
        record = SampleRecord(index, STATUS_OK, name, tokens, len(prompt), nbytes)
        self._record(record, computed=False)
        return True

    # -- the engine ----------------------------------------------------------------------

    def _start_engine(self) -> VllmEngine:
        options = self.options
        import torch

        on_cpu = not torch.cuda.is_available()
        kwargs = engine_settings(options, self.out, on_cpu=on_cpu)
        vllm = import_vllm()
        LLM, SamplingParams = vllm.LLM, vllm.SamplingParams  # noqa: N806 - class names

        self.note(
            f"starting vLLM for {options.model} (layers {options.captured_layers}, "
            f"{self.result.todo:,} samples to do) ..."
        )
        try:
            llm = LLM(model=options.model, **kwargs)
        except Exception as exc:
            raise RuntimeError(f"cannot start vLLM: {_reason(exc)}") from exc
        self.result.engine_started = True

        def params(index: int) -> Any:
            return SamplingParams(
                max_tokens=options.max_tokens,
                temperature=0.0,
                detokenize=False,
                extra_args={
                    "kv_transfer_params": {
                        "hidden_states_path": sample_name(index),
                        "include_output_tokens": options.include_output_tokens,
                    }
                },
            )

        engine = VllmEngine(llm, params)
        self.max_model_len = engine.max_model_len or self.max_model_len
        vocab = [engine.vocab_size or 0]
        if self.encoder is not None:
            with contextlib.suppress(TypeError):
                vocab.append(len(self.encoder.tokenizer))
        self.vocab_size = max(vocab) or None
        assert self.progress is not None
        self.progress.mark_engine_ready()
        return engine

    def _step(self) -> None:
        assert self.engine is not None and self._executor is not None
        for index, output, error in self.engine.step():
            job = self._jobs.pop(index)
            if error is not None:
                self._fail(index, error)
                continue
            future = self._executor.submit(self._finalize, job, output)
            self._pending.append((job, future))
        self._collect()

    def _finalize(self, job: _Job, output: Any) -> SampleRecord:
        """In a verifier thread: wait until the file is final, then check it."""
        try:
            return self._check_output(job, output)
        except Exception as exc:
            return SampleRecord(job.index, STATUS_FAILED, error=f"verification failed: {exc}")

    def _check_output(self, job: _Job, output: Any) -> SampleRecord:
        from hidden_state_reader.format import SharedLock, lock_path, read_status

        params = dict(getattr(output, "kv_transfer_params", None) or {})
        got = params.get("hidden_states_path")
        if not got:
            return SampleRecord(
                job.index,
                STATUS_FAILED,
                error="vLLM returned no hidden_states_path (is the HiddenStateConnector active?)",
            )
        if os.path.realpath(str(got)) != os.path.realpath(job.path):
            return SampleRecord(
                job.index, STATUS_FAILED, error=f"the connector wrote {got}, not {job.path}"
            )
        lock = SharedLock.acquire(job.path, timeout=self.options.lock_timeout)
        if lock is None:
            return SampleRecord(
                job.index,
                STATUS_FAILED,
                error=f"the writer still held the lock after {self.options.lock_timeout:.0f}s",
            )
        try:
            if not os.path.exists(job.path):
                status = read_status(lock_path(job.path))
                reason = (
                    status.reason
                    or params.get("hidden_states_error")
                    or "no file was written (the writer gave no reason)"
                )
                return SampleRecord(job.index, STATUS_FAILED, error=str(reason))
            expected = list(job.prompt)
            if self.options.include_output_tokens:
                generated = list(output.outputs[0].token_ids) if output.outputs else []
                expected += generated[:-1]  # the last token was never fed back
            tokens, nbytes = verify_file(
                job.path,
                job.prompt,
                layer_ids=self.options.captured_layers,
                include_output=self.options.include_output_tokens,
                expected=expected,
            )
        finally:
            lock.release()
        return SampleRecord(
            job.index, STATUS_OK, sample_name(job.index), tokens, len(job.prompt), nbytes
        )

    def _collect(self) -> None:
        """Record the outcomes of finished verifications, in whatever order they finished."""
        waiting: collections.deque[tuple[_Job, concurrent.futures.Future[SampleRecord]]] = (
            collections.deque()
        )
        for job, future in self._pending:
            if not future.done():
                waiting.append((job, future))
            elif not future.cancelled():  # cancelled (interrupted): the next run redoes it
                self._record(future.result())
        self._pending = waiting
        if self.progress is not None:
            self.progress.maybe_print()

    def _drain(self) -> None:
        """Wait for every verification, printing progress meanwhile."""
        while self._pending:
            futures = [f for _, f in self._pending]
            concurrent.futures.wait(
                futures,
                timeout=self.options.progress_interval or 1.0,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
            self._collect()


def run_extract(options: ExtractOptions, stream: TextIO | None = None) -> ExtractResult:
    """Run an extraction (see ``Extraction``)."""
    return Extraction(options, stream).run()
