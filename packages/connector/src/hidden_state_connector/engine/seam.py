"""The seams between the connector's two halves and what varies beneath them.

``WorkerSide`` and ``SchedulerSide`` are one class each; a capture engine plugs in as a
``RowSource`` (worker half: where a save's rows live, the per-step hooks, release) and a
``RowPlanner`` (scheduler half: what each step tells the worker about rows), and a
storage medium as a ``Sink`` (worker half: where a sample is written) and a
``SinkIndex`` (scheduler half: what a client learns, what is written already). The
factory (``engine.engines``) is the one place that picks them (``capture``,
``storage_backend``). Every method here is called on the engine's thread once per step
or per request: implementations keep them cheap (no locks of their own on the way, no
per-step allocations beyond what the step needs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hidden_state_connector.engine.metadata import HiddenStateConnectorMetadata, SaveOrder
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.target import SampleTarget


@dataclass(frozen=True)
class CapturePlan:
    """What both halves need of the engine's capture, checked.

    Attributes:
        group: The KV-cache group whose blocks index the rows (extract: the hidden-state
            group; forward: the attention group its slot mapping routes through).
        block_size: That group's block size.
        layer_ids: Layer ids as captured, in layer-axis order.
        configured: Layer ids as configured.
        slot_layer: Forward capture: an attention layer of ``group`` ("" otherwise).
    """

    group: int
    block_size: int
    layer_ids: list[int] = field(default_factory=list)
    configured: list[int] = field(default_factory=list)
    slot_layer: str = ""


class Saves(Protocol):
    """What a ``RowSource`` may ask of the ``WorkerSide`` that owns it."""

    @property
    def mutex(self) -> threading.RLock:
        """The worker half's lock: the engine's thread and hand-offs both take it."""

    def start_saves(self, orders: Iterable[SaveOrder], *, engine_thread: bool) -> None:
        """Turn save orders into save jobs now (takes ``mutex``)."""

    def flush(self, req_ids: set[str]) -> None:
        """Finish the copies of these requests' samples now (bounded; takes ``mutex``)."""


class RowSource(Protocol):
    """A capture engine's worker half: where rows come from and where a save's rows live.

    The write pipeline copies a save's rows out of ``register``'s ``Extractor`` source,
    block by block, through the block ids ``rows_of`` returns.
    """

    def register(
        self, kv_caches: dict[str, torch.Tensor], writes: bool, saves: Saves
    ) -> Extractor | None:
        """Find the rows' source; the extractor over it, or None: this process writes nothing.

        ``writes``: this is the tensor-parallel rank that writes.
        """

    def before_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """Before the forward pass (vLLM's ``handle_preemptions``)."""

    def bind_forward(self, forward_context: Any, attn_metadata: Any) -> None:
        """The step's forward context, when vLLM hands it over (``start_load_kv``)."""

    def after_forward(self, meta: HiddenStateConnectorMetadata) -> None:
        """After the step's forward pass (``wait_for_save``): its rows and its saves.

        The step's new locks exist already; this starts (or queues) the saves of orders
        ``written_this_step``.
        """

    def queue_saves(self, orders: Iterable[SaveOrder], *, engine_thread: bool) -> None:
        """Start saves whose rows were computed in earlier steps, after the rows in flight."""

    def rows_of(self, order: SaveOrder) -> tuple[list[int], str | None]:
        """Where a save's rows live (blocks of the extractor's source); why not all (None)."""

    def copied(self, req_ids: set[str]) -> set[str]:
        """Saves whose copies are done, requests maybe still running (under ``mutex``).

        Returns the requests whose rows were let go of now (an engine whose rows live in
        vLLM's KV cache lets go of nothing: vLLM frees them once the request is reported).
        """

    def close(self, timeout: float) -> None:
        """Shutdown: rows in flight stored and their saves started (bounded); threads end."""


class RowPlanner(Protocol):
    """A capture engine's scheduler half: what each step tells the worker about rows.

    Attributes:
        output_tokens_refusal: Why this engine cannot store generated tokens on this
            engine's set-up (None: it can).
    """

    output_tokens_refusal: str | None

    def admits(self, request: Any, hit_tokens: int) -> bool:
        """Whether a request may start from its prefix-cache hit (else it waits a step)."""

    def plan_step(
        self,
        meta: HiddenStateConnectorMetadata,
        step: Any,
        block_table: list[int],
        counted: Any,
    ) -> None:
        """A captured request's part of the step (``compat.ScheduledRequest``).

        ``block_table``: its whole block table, kept by ``SchedulerSide`` (the one home).
        ``counted``: the scheduler output, for a request whose drafts are counted.
        """

    def end_step(self, meta: HiddenStateConnectorMetadata, scheduler_output: Any) -> None:
        """After every request of the step was planned."""

    def forget(self, req_id: str) -> None:
        """A request ended."""

    def freed(self, req_ids: Iterable[str]) -> None:
        """The worker is done with these requests (or never held anything for them)."""

    def count_drafts(self, order: SaveOrder, request: Any) -> None:
        """A finish-time order: its drafted and accepted tokens, where counted."""


class Sink(Protocol):
    """A storage medium's worker half: where a sample is written.

    Attributes:
        always_checksum: Every sample carries a CRC32 (its readers check every one).
    """

    always_checksum: bool

    def target(self, req_id: str, path: str) -> SampleTarget:
        """Pin a new request's sample: its directory and its lock.

        Raises:
            OSError: It cannot be created.
            PathOutsideRootError: ``path`` leaves the root.
        """

    def staged_path(self, path: str) -> str:
        """Where the writer writes the sample bound for ``path``."""

    def close(self) -> None:
        """Leave the medium (idempotent)."""


class SinkIndex(Protocol):
    """A storage medium's scheduler half: what is written, what a client learns."""

    def unusable(self, path: str) -> str | None:
        """Why a client-chosen ``path`` cannot be written (None: it can, or not known)."""

    def written(self, path: str) -> bool:
        """Whether the keyed sample bound for ``path`` is written (or consumed)."""

    def client_params(self, path: str) -> dict[str, str] | None:
        """What a client learns of its sample (None: its path)."""

    def close(self) -> None:
        """Leave the medium (idempotent)."""
