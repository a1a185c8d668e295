"""The end of a demo run: what the producer and the trainer did, checked.

``collect`` copies their counts, rates and losses into the ``DemoSummary``; ``check``
adds a failure for every way in which the prompts did not become exactly one
trained-on sample each.
"""

from __future__ import annotations

import os
import time

from hidden_state_connector.apps.demo.producer import Producer
from hidden_state_connector.apps.demo.report import DemoSummary
from hidden_state_connector.apps.demo.trainer import Trainer


def count_files(root: str) -> int:
    """Regular files below ``root`` (0 if it does not exist)."""
    return sum(len(files) for _, _, files in os.walk(root))


def collect(s: DemoSummary, producer: Producer, trainer: Trainer, estimate: float) -> None:
    """Copy counts, rates, losses and errors into the summary.

    Args:
        s: The summary to fill.
        producer: The finished producer.
        trainer: The finished trainer.
        estimate: Bytes per token to assume if the trainer recorded none.
    """
    s.produced, s.failed_requests, s.tokens_produced = (
        producer.produced,
        producer.failed,
        producer.tokens,
    )
    s.consumed, s.tokens_consumed, s.bytes_read = (
        trainer.consumed,
        trainer.tokens,
        trainer.bytes,
    )
    s.unique_consumed = len({os.path.basename(p) for p in trainer.paths})
    s.bytes_written = round(producer.tokens * (trainer.bytes_per_token or estimate))
    s.reader_skipped = trainer.reader_stats.skipped
    s.optimizer_steps = trainer.steps
    s.step_losses = list(trainer.step_losses)
    s.batch_losses = list(trainer.batch_losses)
    if s.batch_losses:
        s.initial_loss = s.batch_losses[0][2]
        s.final_loss = trainer.recent_loss()
    if producer.started_at is not None:
        now = time.monotonic()
        s.produce_s = max((producer.finished_at or now) - producer.started_at, 1e-9)
        s.produce_tokens_per_s = s.tokens_produced / s.produce_s
        s.write_mb_per_s = s.bytes_written / 1e6 / s.produce_s
        end = trainer.last_sample_at or producer.finished_at or now
        s.stream_s = max(end - producer.started_at, 1e-9)
        s.samples_per_s = s.consumed / s.stream_s
        s.tokens_per_s = s.tokens_consumed / s.stream_s
        s.read_mb_per_s = s.bytes_read / 1e6 / s.stream_s
    s.errors += producer.errors
    for what, exc in (("producer", producer.error), ("trainer", trainer.error)):
        if exc is not None:
            s.failures.append(f"{what} failed: {type(exc).__name__}: {exc}")


def check(s: DemoSummary, producer: Producer, trainer: Trainer) -> None:
    """Add a failure for every prompt not sent, sample lost, doubled or rejected."""
    if s.failed_requests:
        s.failures.append(f"{s.failed_requests} requests produced no sample")
    if s.produced != s.prompts - s.failed_requests:
        s.failures.append(f"{s.prompts - s.produced - s.failed_requests} prompts never sent")
    if s.produced != s.consumed:
        s.failures.append(f"produced {s.produced} != consumed {s.consumed}")
    if s.unique_consumed != s.consumed:
        s.failures.append(f"{s.consumed - s.unique_consumed} samples consumed twice")
    produced = {os.path.basename(p) for p in producer.paths}
    consumed = {os.path.basename(p) for p in trainer.paths}
    if produced - consumed:
        s.failures.append(f"{len(produced - consumed)} samples lost (produced, never consumed)")
    if consumed - produced:
        s.failures.append(f"{len(consumed - produced)} samples consumed that were not produced")
    if s.reader_skipped:
        s.failures.append(f"{s.reader_skipped} samples rejected by the reader")
