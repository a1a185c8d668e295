"""Pipeline parallelism: which stage captures which layer, and how its rows reach the writer.

Each pipeline stage holds only its own decoder layers, so each captures the layer ids it
computes (id 0 on the first stage, id k on the stage owning layer k-1; vLLM's partition,
``VLLM_PP_LAYER_PARTITION`` included). One worker writes every sample: tensor-parallel
rank 0 of the last stage. It creates the locks, keeps the arena of all layers, reports
finished requests (``get_finished_count`` stays 1) and publishes once. Rank 0 of every
other stage copies its rows of each step to the host and sends them, with their KV slots,
to the writer over a gloo group of those ranks (``StageLink``; vLLM's own
``torch.distributed`` world, so it reaches wherever vLLM's stages run, other nodes
included). The writer's ingest thread takes each step's parts in step order and routes
them into the arena's columns of that stage's layers: a sample's save starts only after
every stage's rows of its last step are in. A stage whose rows cannot be copied sends a
failure instead, and the samples of that step's requests fail with its reason; a broken
channel fails every later sample (docs/connector.md, "Pipeline parallelism").
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hidden_state_connector.engine.forward.ingest import IngestThread
from hidden_state_connector.engine.forward.transfer import StepCopy, StepTransfer
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)

_OK, _FAILED = 0, 1
_HEADER = 2  # int64s: rows, status


@dataclass(frozen=True)
class StagePlan:
    """Where each captured layer id is computed.

    Attributes:
        stage: This worker's stage.
        num_stages: Pipeline stages.
        layer_ids: Every captured layer id, ascending (the file's layer axis).
        owners: The stage that computes each of ``layer_ids``.
    """

    stage: int
    num_stages: int
    layer_ids: tuple[int, ...]
    owners: tuple[int, ...]

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (its TP rank 0 writes)."""
        return self.stage == self.num_stages - 1

    def ids_of(self, stage: int) -> list[int]:
        """The captured ids a stage computes, ascending."""
        return [i for i, s in zip(self.layer_ids, self.owners, strict=True) if s == stage]

    def columns(self, stage: int) -> slice:
        """The layer-axis columns of a stage's ids (contiguous: stages own runs of layers)."""
        axes = [a for a, s in enumerate(self.owners) if s == stage]
        return slice(axes[0], axes[-1] + 1) if axes else slice(0, 0)

    @property
    def senders(self) -> list[int]:
        """Stages other than the last that compute captured ids (they send rows)."""
        return [s for s in range(self.num_stages - 1) if s in self.owners]


def plan_stages(
    layer_ids: Sequence[int], ranges: Sequence[tuple[int, int]], stage: int
) -> StagePlan:
    """Assign each captured id to the stage whose layers compute it.

    Args:
        layer_ids: Captured ids, ascending.
        ranges: Decoder layers ``[start, end)`` of each stage (``compat.pipeline_layer_ranges``).
        stage: This worker's stage.
    """
    owners = []
    for layer_id in layer_ids:
        layer = max(layer_id - 1, 0)  # id 0 enters layer 0; id k leaves layer k-1
        owners.append(next(s for s, (lo, hi) in enumerate(ranges) if lo <= layer < hi))
    return StagePlan(stage, len(ranges), tuple(layer_ids), tuple(owners))


def stage_plan(layer_ids: Sequence[int], num_layers: int) -> StagePlan:
    """``plan_stages`` for this worker (one stage owning every layer without PP)."""
    from hidden_state_connector.engine import compat

    stage, num_stages = compat.pipeline_stage()
    if num_stages == 1:
        return plan_stages(layer_ids, [(0, num_layers)], 0)
    return plan_stages(layer_ids, compat.pipeline_layer_ranges(num_layers, num_stages), stage)


class StageLinkError(RuntimeError):
    """A stage's rows did not arrive (the stage failed, or the channel broke)."""


class StageLink:
    """Point-to-point rows between the stages' writing ranks, over a gloo group of their own.

    Every member must construct it (a collective of the members only). Messages go in
    step order, one per step with captured requests, from each sending stage to the last.

    Args:
        peers: Global rank of each stage's member (``compat.pipeline_peers``).
        stage: This worker's stage.
        timeout_s: How long a receive may wait for a stage before failing.
    """

    def __init__(self, peers: Sequence[int], stage: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.peers = list(peers)
        self.stage = stage
        self.group = dist.new_group(
            self.peers,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
        self.broken: str | None = None

    def send(
        self, slots: torch.Tensor | None, rows: torch.Tensor | None, failure: str = ""
    ) -> None:
        """Send one step's rows ``[n, layers, hidden]`` and slots ``[n]`` (or a failure)."""
        dst = self.peers[-1]
        ok = failure == "" and slots is not None and rows is not None
        n = int(slots.shape[0]) if ok and slots is not None else 0
        header = torch.tensor([n, _OK if ok else _FAILED], dtype=torch.int64)
        self._dist.send(header, dst, group=self.group)
        if ok and n and slots is not None and rows is not None:
            self._dist.send(slots.contiguous(), dst, group=self.group)
            self._dist.send(_as_bytes(rows), dst, group=self.group)

    def receive(
        self, stage: int, num_layers: int, hidden: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's slots and rows ``[n, num_layers, hidden]`` from ``stage``.

        Raises:
            StageLinkError: The stage sent a failure, or the channel broke (then every
                later receive fails too: the step order is lost).
        """
        if self.broken is not None:
            raise StageLinkError(self.broken)
        src = self.peers[stage]
        try:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self._dist.recv(header, src, group=self.group)
            n, status = (int(v) for v in header.tolist())
            slots = torch.empty(n, dtype=torch.int64)
            rows = torch.empty(n, num_layers, hidden, dtype=dtype)
            if status == _OK and n:
                self._dist.recv(slots, src, group=self.group)
                self._dist.recv(_as_bytes(rows), src, group=self.group)
        except Exception as exc:
            self.broken = f"pipeline stage {stage}'s rows channel broke: {exc!r}"
            raise StageLinkError(self.broken) from exc
        if status != _OK:
            raise StageLinkError(f"pipeline stage {stage} could not copy this step's rows")
        return slots, rows

    def close(self) -> None:
        """Drop the group (shutdown; errors ignored: the peers may be gone)."""
        with contextlib.suppress(Exception):  # the world may already be torn down
            self._dist.destroy_process_group(self.group)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as one flat uint8 tensor (gloo sends any dtype so)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


class StageSender:
    """A sending stage's half (rank 0 of a stage other than the last): rows out, step by step.

    The engine's thread only starts the step's host copy (``StepTransfer``); one thread
    waits for it and sends it, in step order, so the model never waits for the network.
    Steps without captured requests send nothing (the writer expects nothing either).

    Args:
        transfer: Copies this stage's staging rows to the host.
        link: The channel to the writer.
        sends: Whether this stage computes any captured id (else it never sends).
    """

    def __init__(self, transfer: StepTransfer, link: StageLink, *, sends: bool) -> None:
        self.transfer = transfer
        self.link = link
        self.sends = sends
        self.thread = IngestThread("hidden-state-stage-send", self._failed)

    def step(self, has_steps: bool, num_rows: int, slots: Callable[[], torch.Tensor]) -> None:
        """After a forward pass (engine's thread): queue this step's rows for the writer."""
        if not (self.sends and has_steps):
            return
        try:
            with torch.inference_mode():
                mapping = slots()
                copy: StepCopy | None = self.transfer.submit(num_rows or mapping.shape[0], mapping)
        except Exception as exc:  # the writer still expects this step: it gets a failure
            log.error("forward capture: this stage's rows could not be copied: %r", exc)
            copy = None
        self.thread.put(lambda: self._send(copy))

    def _send(self, copy: StepCopy | None) -> None:
        if copy is None:
            self.link.send(None, None, failure="copy failed")
            return
        try:
            copy.wait()
        except Exception as exc:
            log.error("forward capture: this stage's rows could not be copied: %r", exc)
            self.transfer.done(copy)
            self.link.send(None, None, failure=repr(exc))
            return
        try:
            self.link.send(copy.slots, copy.rows)
        finally:
            self.transfer.done(copy)

    def _failed(self, exc: BaseException) -> None:
        log.error("forward capture: rows could not be sent to the last stage: %r", exc)

    def shutdown(self, timeout: float) -> None:
        """Send what is queued (bounded), then stop."""
        if not self.thread.stop(timeout):
            log.warning("forward capture: rows still queued for the last stage were dropped")
        self.link.close()


Part = tuple[slice | None, torch.Tensor, torch.Tensor]
"""One stage's rows of a step: its layer-axis columns (None: all), slots, rows."""


@dataclass
class Pipeline:
    """This worker's part in a pipeline-parallel capture (``join_pipeline``).

    Attributes:
        plan: Which stage computes which id.
        link: The channel between the stages' writing ranks (None: one stage).
        sender: This stage's sender (None on the last stage, which writes).
    """

    plan: StagePlan
    link: StageLink | None = None
    sender: StageSender | None = None

    def parts(
        self,
        own: StepCopy,
        has_steps: bool,
        shape: tuple[int, torch.dtype],
        fail: Callable[[str], None],
    ) -> list[Part]:
        """Every stage's rows of a step, at the writer (the other stages' first, in order).

        Every sending stage's message of the step is taken, whatever happens, so the step
        order holds; a stage whose rows did not come calls ``fail`` with why.
        """
        if self.link is None:
            return [(None, own.slots, own.rows)]
        hidden, dtype = shape
        parts: list[Part] = []
        for stage in self.plan.senders if has_steps else ():
            columns = self.plan.columns(stage)
            width = columns.stop - columns.start
            try:
                slots, rows = self.link.receive(stage, width, hidden, dtype)
            except StageLinkError as exc:
                log.error("forward capture: %s; the samples of its requests fail", exc)
                fail(str(exc))
                continue
            parts.append((columns, slots, rows))
        columns = self.plan.columns(self.plan.stage)
        if columns.stop > columns.start:
            parts.append((columns, own.slots, own.rows))
        return parts

    def start_sending(self, staging_rows: torch.Tensor) -> None:
        """On a stage before the last: send this stage's rows of every step from now on."""
        assert self.link is not None
        sends = bool(self.plan.ids_of(self.plan.stage))
        self.sender = StageSender(StepTransfer(staging_rows), self.link, sends=sends)

    def close(self, timeout: float) -> None:
        """Send what is queued (a sender), then drop the channel."""
        if self.sender is not None:
            self.sender.shutdown(timeout)
        elif self.link is not None:
            self.link.close()


def join_pipeline(layer_ids: Sequence[int], num_layers: int, timeout_s: float) -> Pipeline:
    """This worker's role; under pipeline parallelism, join the stages' channel.

    Called by tensor-parallel rank 0 of every stage (the channel's members) at start-up;
    a stage before the last then calls ``Pipeline.start_sending``.
    """
    from hidden_state_connector.engine import compat

    plan = stage_plan(layer_ids, num_layers)
    if plan.num_stages == 1:
        return Pipeline(plan)
    link = StageLink(compat.pipeline_peers(), plan.stage, timeout_s)
    log.info(
        "forward capture: pipeline stage %d of %d captures layers %s; %s",
        plan.stage,
        plan.num_stages,
        plan.ids_of(plan.stage),
        "writes every sample" if plan.is_last else "sends its rows to the last stage",
    )
    return Pipeline(plan, link)
