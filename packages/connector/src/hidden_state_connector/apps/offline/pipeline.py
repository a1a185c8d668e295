"""The sample flow of an extraction: records -> prompts -> vLLM -> verified files -> manifest.

``Pipeline`` tokenizes the records ``ENCODE_CHUNK`` at a time (so vLLM is fed while the
rest is tokenized), settles what it can without vLLM (invalid records, prompts that are
too long or out of vocabulary, files an earlier run left on disk), starts vLLM at the
first prompt that needs it, keeps up to ``batch_size`` requests in flight and hands each
finished one to the verifier threads. Every outcome goes to the manifest, the run's
counts and the progress line, in ``record``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator

from hidden_state_connector.apps.offline.check_pool import Job, Verifier
from hidden_state_connector.apps.offline.engine import VllmEngine, start_engine
from hidden_state_connector.apps.offline.inputs import (
    Prompt,
    PromptEncoder,
    RawItem,
    load_tokenizer,
)
from hidden_state_connector.apps.offline.manifest import (
    STATUS_FAILED,
    Manifest,
    SampleRecord,
    sample_name,
)
from hidden_state_connector.apps.offline.progress import ExtractCounters
from hidden_state_connector.apps.offline.result import ExtractResult
from hidden_state_connector.apps.offline.resume import recover
from hidden_state_connector.apps.offline.settings import ExtractOptions

ENCODE_CHUNK = 64  # records tokenized at a time (keeps vLLM fed while tokenizing)


def _chunks(items: Iterator[RawItem], size: int) -> Iterator[list[RawItem]]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


class Pipeline:
    """Turns the records to do into recorded outcomes (see the module docstring).

    Args:
        options: The run's options.
        out: The output directory (absolute).
        manifest: Where outcomes are appended.
        result: The run's counts.
        progress: The progress line.
        note: Prints a line on the progress stream.
    """

    def __init__(
        self,
        options: ExtractOptions,
        out: str,
        manifest: Manifest,
        result: ExtractResult,
        progress: ExtractCounters,
        note: Callable[[str], None],
    ) -> None:
        self.options = options
        self.out = out
        self.manifest = manifest
        self.result = result
        self.progress = progress
        self.note = note
        self.engine: VllmEngine | None = None
        self.encoder: PromptEncoder | None = None
        self.verifier = Verifier(options)
        self.max_model_len = options.max_model_len
        self.vocab_size: int | None = None
        self._jobs: dict[int, Job] = {}  # submitted to vLLM, not yet returned

    def run(self, items: Iterator[RawItem]) -> None:
        """Handle every item, then wait for vLLM and the verifiers."""
        options = self.options
        for chunk in _chunks(items, max(1, min(ENCODE_CHUNK, options.batch_size))):
            if self.encoder is None:
                self.encoder = PromptEncoder(load_tokenizer(options.model, options.engine_args))
            for prompt in self.encoder.encode(chunk):
                self._handle(prompt)
            self._collect()
        while self.engine is not None and self.engine.in_flight:
            self._step()
        self._drain()

    def close(self) -> None:
        """Let the running verifications finish and record them; cancel the queued ones."""
        self.verifier.shutdown()
        self._collect()

    def record(self, record: SampleRecord, *, computed: bool = True) -> None:
        """Record an outcome (``computed`` False when the file was already on disk)."""
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
        self.record(SampleRecord(index, STATUS_FAILED, error=reason))

    # -- per sample ----------------------------------------------------------------------

    def _handle(self, prompt: Prompt) -> None:
        index = prompt.index
        if prompt.error is not None or prompt.token_ids is None:
            self._fail(index, prompt.error or "no prompt")
            return
        path = os.path.join(self.out, sample_name(index))
        if os.path.lexists(path):
            record = recover(
                index, path, prompt.token_ids, self.options, self.result, prompt.loss_mask
            )
            if record is not None:
                self.record(record, computed=False)
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
        error = self.engine.submit(index, prompt.token_ids, prompt.loss_mask)
        if error is not None:
            self._fail(index, error)
            return
        self._jobs[index] = Job(index, path, prompt.token_ids, prompt.loss_mask)
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

    # -- the engine and the verifiers ----------------------------------------------------

    def _start_engine(self) -> VllmEngine:
        options = self.options

        def announce() -> None:
            self.note(
                f"starting vLLM for {options.model} (layers {options.captured_layers}, "
                f"{self.result.todo:,} samples to do) ..."
            )

        engine = start_engine(options, self.out, announce=announce)
        self.result.engine_started = True
        self.max_model_len = engine.max_model_len or self.max_model_len
        vocab = [engine.vocab_size or 0]
        if self.encoder is not None:
            with contextlib.suppress(TypeError):
                vocab.append(len(self.encoder.tokenizer))
        self.vocab_size = max(vocab) or None
        self.progress.mark_engine_ready()
        return engine

    def _step(self) -> None:
        assert self.engine is not None
        for index, output, error in self.engine.step():
            job = self._jobs.pop(index)
            if error is not None:
                self._fail(index, error)
                continue
            self.verifier.submit(job, output)
        self._collect()

    def _collect(self) -> None:
        """Record the outcomes of finished verifications, in whatever order they finished."""
        self.verifier.collect(self.record)
        self.progress.maybe_print()

    def _drain(self) -> None:
        """Wait for every verification, printing progress meanwhile."""
        while self.verifier.pending:
            self.verifier.wait(timeout=self.options.progress_interval or 1.0)
            self._collect()
