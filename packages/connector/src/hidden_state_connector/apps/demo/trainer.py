"""The consumer side of the demo: a follow-mode reader feeding a draft-head training loop."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from hidden_state_connector.apps.draft_head import DraftHead, next_token_loss
from hidden_state_reader import ReaderStats, Sample
from hidden_state_reader.training.collate import PadCollate
from hidden_state_reader.training.dataset import HiddenStateDataset

log = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    """How the draft head is trained.

    Attributes:
        batch_size: Samples per batch.
        steps_per_batch: Optimizer steps on each batch (the first one's loss is computed
            on data the head has never seen).
        lr: Adam learning rate.
        device: Torch device for the head.
        seed: Initialisation seed.
        on_consumed: What the reader does with a file once it was used (``"delete"``
            or ``"keep"``).
        idle_poll: Seconds the reader waits for a new sample before the loop checks
            whether it is done.
    """

    batch_size: int = 8
    steps_per_batch: int = 4
    lr: float = 1e-2
    device: str = "cpu"
    seed: int = 0
    on_consumed: str = "delete"
    idle_poll: float = 0.5


@dataclass
class _Batch:
    tensors: dict[str, Any]
    nbytes: int
    tokens: int
    paths: list[str] = field(default_factory=list)


class _Collate:
    """``PadCollate`` plus the byte and token counts of the samples."""

    def __init__(self) -> None:
        self._pad = PadCollate(pad_token_id=0)

    def __call__(self, samples: Sequence[Sample]) -> _Batch:
        return _Batch(
            self._pad(samples),
            sum(s.nbytes for s in samples),
            sum(s.num_tokens for s in samples),
            [os.path.abspath(s.path) for s in samples],
        )


class Trainer:
    """Read samples as vLLM writes them and train a ``DraftHead`` on them, in a thread.

    The reader follows the directory and claims each sample, so every file is trained
    on exactly once and deleted after use. The loop ends when ``keep_going()`` says so
    (checked whenever no sample arrived for ``idle_poll`` seconds) or ``stop`` is set.

    Args:
        root: The hidden-state directory the server writes to.
        vocab_size: Vocabulary of the target model.
        config: Training settings.
        keep_going: Called while idle: False ends the loop.
        stop: Set to end the loop at the next batch.
    """

    def __init__(
        self,
        root: str,
        vocab_size: int,
        config: TrainerConfig,
        *,
        keep_going: Callable[[], bool],
        stop: threading.Event,
    ) -> None:
        self.root = root
        self.vocab_size = vocab_size
        self.config = config
        self._keep_going = keep_going
        self._stop = stop
        self._lock = threading.Lock()
        self.consumed = 0
        self.tokens = 0
        self.bytes = 0
        self.steps = 0
        self.paths: list[str] = []
        self.step_losses: list[float] = []
        """Loss of every optimizer step."""
        self.batch_losses: list[tuple[int, int, float]] = []
        """(step, samples consumed, loss) of each batch's first step: loss on unseen data."""
        self._batch_tokens: list[int] = []  # predicted tokens of each batch_losses entry
        self.reader_stats = ReaderStats()
        self.bytes_per_token: float | None = None
        self.last_sample_at: float | None = None
        self.first_sample_at: float | None = None
        self.head: DraftHead | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hs-demo-trainer", daemon=True)

    def recent_loss(self, batches: int = 3) -> float | None:
        """Loss on unseen data of the last ``batches`` batches (weighted by their tokens)."""
        with self._lock:
            losses = [v for _, _, v in self.batch_losses[-batches:]]
            weights = self._batch_tokens[-batches:]
        if not losses:
            return None
        return sum(v * w for v, w in zip(losses, weights, strict=True)) / sum(weights)

    def start(self) -> None:
        """Start the training thread."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread."""
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            torch.manual_seed(self.config.seed)
            dataset = HiddenStateDataset(
                self.root,
                follow=True,
                claim=True,
                on_consumed=self.config.on_consumed,
                idle_timeout=self.config.idle_poll,
            )
            loader = DataLoader(
                dataset, batch_size=self.config.batch_size, collate_fn=_Collate(), num_workers=0
            )
            optimizer: torch.optim.Optimizer | None = None
            while not self._stop.is_set():
                # Each pass follows the directory until it is idle for ``idle_poll``.
                for batch in loader:
                    if self.head is None:
                        self.head, optimizer = self._build(batch)
                    assert optimizer is not None
                    self._train(batch, optimizer)
                    if self._stop.is_set():
                        break
                if not self._keep_going():
                    break
            self.reader_stats = dataset.stats
        except BaseException as exc:  # reported by the orchestrator
            self.error = exc
            log.debug("trainer failed", exc_info=True)
        finally:
            self.done.set()

    def _build(self, batch: _Batch) -> tuple[DraftHead, torch.optim.Optimizer]:
        _, _, num_layers, hidden_size = batch.tensors["hidden_states"].shape
        head = DraftHead(num_layers, hidden_size, self.vocab_size).to(self.config.device)
        optimizer = torch.optim.Adam(head.parameters(), lr=self.config.lr)
        return head, optimizer

    def _train(self, batch: _Batch, optimizer: torch.optim.Optimizer) -> None:
        assert self.head is not None
        device = self.config.device
        input_ids = batch.tensors["input_ids"].to(device)
        mask = batch.tensors["attention_mask"].to(device)
        hidden = batch.tensors["hidden_states"].to(device)
        top = int(input_ids.max())
        if top >= self.vocab_size:
            raise ValueError(f"token id {top} is outside the vocabulary of {self.vocab_size}")
        now = time.monotonic()
        with self._lock:
            if self.first_sample_at is None:
                self.first_sample_at = now
            self.last_sample_at = now
            self.consumed += len(batch.paths)
            self.tokens += batch.tokens
            self.bytes += batch.nbytes
            self.paths.extend(batch.paths)
            if self.bytes_per_token is None and batch.tokens:
                self.bytes_per_token = batch.nbytes / batch.tokens
        for step in range(self.config.steps_per_batch):
            loss, count = next_token_loss(self.head(hidden), input_ids, mask)
            if count == 0:
                return
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            optimizer.step()
            value = float(loss.detach())
            with self._lock:
                self.steps += 1
                self.step_losses.append(value)
                if step == 0:
                    self.batch_losses.append((self.steps, self.consumed, value))
                    self._batch_tokens.append(count)
